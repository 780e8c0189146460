"""Values across a process boundary: the structure pickled, the tensor bytes beside it.

Both directions (the cell's closure, kernel -> ranks; rank 0's names, rank 0 -> kernel)
use the same three pieces:

- ``pack.py`` pickles named values in order, each its own *segment* of one pickle
  stream with one memo, so two names for one object stay one object. Every torch
  storage and plain numpy array is replaced by a persistent id: its bytes are a *blob*
  that is never pickled. A value that cannot be pickled costs only its own name.
- ``memfile.py`` lays the blobs out in one owner-only memory file (``/dev/shm``) that
  the receiver maps, or inline in the frame when they are small. The authenticated
  frame carries a SHA-256 per 8 MB chunk of the file; the receiver checks them before
  it builds anything on those bytes.
- ``unpack.py`` loads the segments in order, builds tensors and arrays straight on the
  mapping (no copy), and loses only the segments that fail (and those that share an
  object with one that failed).

Beside them:

- ``pickler.py``: the cloudpickle pickler every taas pickle of notebook code goes through, with
  its own reducer for code objects (the notebook's lines kept).
- ``cudaipc.py`` carries CUDA storages between processes of one host device to device
  (torch's CUDA IPC handles in the frame, each receiver copying onto its own GPU), where the
  run offers it; any failure falls back to the memory file, which serves everything else.
- ``unwrap.py`` says which wrappers (DistributedDataParallel, ``torch.compile``'s
  OptimizedModule, FSDP) travel as the module they wrap.
- ``records.py``: the data workers' element format, read back without a copy.

The kernel's and the rank's ends:

- ``handoff.py`` sends the closure and answers the ranks' requests for it.
- ``returns.py`` is rank 0 sending what the cell bound.
- ``results.py`` is the kernel binding it in the notebook; the final expression -> ``Out``.
- ``keptnames.py`` is the notebook's stand-in for a kept cell's large name left on rank 0, copied
  when first touched.

Sharded names (an FSDP2 or DTensor-sharded module, a state dict of DTensors) are made whole
before rank 0 packs them:

- ``sharded.py`` is every rank's gather after the cell (the names agreed, then each DTensor's
  ``full_tensor()`` in turn, rank 0 keeping CPU copies);
- ``unshard.py`` makes rank 0's module an ordinary one again;
- ``dcphandle.py`` is the handle a name too big for the notebook's host becomes, to the DCP
  checkpoint the ranks wrote for it.
"""
