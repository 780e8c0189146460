"""CUDA storages between the kernel and the ranks of its host by CUDA IPC: device to device.

Runs in the kernel (:func:`kernel_ready` and the closure's export in a run's plan step; rank 0's
storages copied on the run's own thread; :func:`release` as the run ends) and in each rank, on its
main thread (the closure's handles opened; rank 0's results exported).

The exporter synchronises the devices involved, then hands out torch's own IPC handle of
each CUDA storage (``untyped_storage._share_cuda_()``, the 8-item tuple
torch/multiprocessing/reductions.py sends: device, memory handle, size, offset in the
allocation, ref-counter file and slot, event handle, whether to wait on that event). The
importer opens it (``torch.UntypedStorage._new_shared_cuda``, on the exporter's device
index; the event need not be waited on, the exporter having synchronised: see
:func:`_open`), copies the bytes into a storage of its own, synchronises, and drops the
opened storage (which gives back the exporter's count); only then may the exporter free
its memory. The handles travel in authenticated frames (wire.py), like everything else.

Contract:

- :func:`kernel_ready` is the kernel's plan-time probe, and it creates no CUDA context:
  true unless ``TAAS_CUDA_IPC`` (read here and nowhere else) is ``0`` or the kernel's torch
  has no CUDA (``torch.cuda.is_available()`` when torch is imported; a kernel that has not
  imported torch yet will, to build rank 0's tensors, and makes its context when it opens
  the first handle, as it would to place those tensors on their GPU anyway). The caller
  asks it only for a run on this host's GPUs. :func:`unavailable` says why not. The run
  offers CUDA IPC only when the ranks share this host's memory too (``RunSpec.cuda_ipc``);
  otherwise nothing here runs and the memory file (memfile.py) carries every byte, as it
  always did.
- :func:`export` synchronises the devices involved (so work queued on any stream is in
  the bytes) and exports each CUDA blob with bytes. A blob that cannot be exported (a
  storage torch received by IPC itself, one from another allocator) stays a host blob.
- :func:`open_all` opens every handle or none; :func:`own_copy` copies an opened storage
  onto a device (a plain copy: across devices it works with or without peer access) and
  drops the opened one. Any exception is the caller's signal to use host memory instead.
- :func:`release` gives back the kernel's side of torch's IPC ref counts when the cell
  ends (the ranks are gone by then), so the kernel's storage is freed normally when the
  notebook drops it and never waits in torch's "limbo" for a consumer that died.

Who falls back, and how (handoff.py, transfer/returns.py, results.py):

- Closure (kernel -> ranks): the kernel keeps its packing, hence every exported storage,
  until the cell ends. A rank that cannot open a handle (any exception: another device
  set, ``expandable_segments:True`` where ``pidfd_getfd`` on the kernel is refused, an
  error of the driver) asks the kernel for a host copy (a ``ClosureHostWanted`` frame, protocol.py); the
  kernel writes one memory file of the exported blobs the first time it is asked, and
  answers every rank that asks with it. The other ranks keep their device copies.
- Results (rank 0 -> kernel): rank 0 sends the handles in its ``result`` frame and waits
  (at most :data:`RELEASE_SECONDS`, or until the connection closes) for the kernel's
  answer: ``Released`` (the kernel holds its copies: rank 0 exits) or ``SendHost``
  (rank 0 writes those blobs to the memory file and sends the result again, today's way).
  A rank 0 killed while it waits dies by the kernel's stop ladder, as any rank does.

Failure modes: an opened storage is dropped on every path (the copy made so far too), so
a failure leaves nothing mapped; a process that dies holding a mapping loses it with its
CUDA context. Each rank that opens a handle of a device other than its own makes a CUDA
context on that device (a few hundred MB of that GPU, for the rank's life).

Memory at the peak, on the GPUs and on the host: results, rank 0's tensor and the
kernel's copy (two on the GPU, none on the host); closure, the kernel's tensor and each
rank's copy on its own GPU (1 + N on the GPUs, none on the host). The memory file path,
when it serves, costs what memfile.py says (a host copy, and the device copies).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Sequence

from taas_magic.tempdirs import SHM
from taas_magic.transfer.pack import Blob

VARIABLE = "TAAS_CUDA_IPC"  # "0" (or off/false/no): never use CUDA IPC; the memory file serves
RELEASE_SECONDS = 60.0  # how long rank 0 keeps its exported tensors for the kernel's answer

Handle = tuple  # torch's _share_cuda_() tuple, 8 items


def unavailable() -> str | None:
    """Why the kernel cannot offer CUDA IPC now (None: it can); creates no CUDA context."""
    if os.environ.get(VARIABLE, "").strip().lower() in ("0", "off", "false", "no"):
        return f"{VARIABLE}={os.environ[VARIABLE]}"
    torch = sys.modules.get("torch")
    if torch is not None and not torch.cuda.is_available():
        return "the kernel's torch has no CUDA"
    return None


def kernel_ready() -> bool:
    """The plan-time probe: whether the kernel can offer CUDA IPC to ranks on its host."""
    return unavailable() is None


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def size_text(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def is_cuda(blob: Blob) -> bool:
    """A torch storage on a CUDA device (asks the storage, never CUDA)."""
    return blob.kind == "s" and blob.address is None and blob.source.device.type == "cuda"


def tally(blobs: Sequence[Blob], indices: Iterable[int]) -> tuple[int, int]:
    """How many of those blobs are CUDA storages with bytes, and their bytes."""
    cuda = [blobs[i].nbytes for i in indices if is_cuda(blobs[i]) and blobs[i].nbytes]
    return len(cuda), sum(cuda)


def export(blobs: Sequence[Blob], indices: Iterable[int]) -> tuple[dict[int, Handle], str]:
    """Each CUDA blob of ``indices`` with bytes exported (index -> handle), and why any was not."""
    wanted = [i for i in indices if is_cuda(blobs[i]) and blobs[i].nbytes]
    if not wanted:
        return {}, ""
    import torch

    handles: dict[int, Handle] = {}
    why = ""
    try:
        for device in sorted({blobs[i].source.device.index or 0 for i in wanted}):
            torch.cuda.synchronize(device)  # whatever stream wrote them, the bytes are final
    except Exception as exc:  # noqa: BLE001 - any CUDA error: every blob goes through host memory
        return {}, describe(exc)
    for index in wanted:
        try:
            handles[index] = tuple(blobs[index].source._share_cuda_())  # private API: see taas_magic/private.py
        except Exception as exc:  # noqa: BLE001 - this blob goes through host memory; the others need not
            why = why or describe(exc)
    return handles, why


def _open(handle: Handle) -> Any:
    """The exporter's storage, mapped here. IMPORTANT: :func:`export` synchronised the exporter's
    devices before exporting, so the bytes are final and the handle's IPC event is not waited on:
    torch opens that event (``cudaIpcOpenEventHandle``) and never closes it, one leaked event per
    storage in a kernel that lives for days.

    IMPORTANT: ``_new_shared_cuda`` does not initialise torch's CUDA state; called first in a
    process that never used CUDA (a kernel whose first CUDA value is rank 0's result), it killed
    the process outright, with no message (H100, torch 2.11, 2026-11-27). ``torch.cuda.init()``
    (idempotent) comes first, and raises an exception the callers fall back on."""
    import torch

    torch.cuda.init()
    return torch.UntypedStorage._new_shared_cuda(*handle[:7], False)  # private API: see taas_magic/private.py


def open_all(handles: dict[int, Handle]) -> tuple[dict[int, Any], str]:
    """Every handle opened here (index -> the exporter's storage, mapped, not copied), or none and why."""
    opened: dict[int, Any] = {}
    try:
        for index, handle in handles.items():
            opened[index] = _open(handle)
    except Exception as exc:  # noqa: BLE001 - any IPC error: the caller asks for host memory
        opened.clear()  # dropping them releases the mappings (and the exporter's counts)
        return {}, describe(exc)
    return opened, ""


def own_copy(opened: Any, device: int) -> Any:
    """A storage of this process on ``cuda:device`` holding the opened storage's bytes, synchronised.

    The caller drops ``opened`` afterwards; its deleter waits for its stream and gives back
    the exporter's count.
    """
    import torch

    source = torch.empty(0, dtype=torch.uint8, device=opened.device).set_(opened)
    copy = torch.empty(source.numel(), dtype=torch.uint8, device=f"cuda:{device}")
    copy.copy_(source)
    for index in {device, opened.device.index or 0}:
        torch.cuda.current_stream(index).synchronize()
    return copy.untyped_storage()


def take(handles: Sequence[Handle]) -> list[Any]:
    """The kernel's copies of rank 0's exported storages, each on the device it had there.

    Raises:
        Exception: any (an IPC or CUDA error, a device this kernel lacks); nothing is kept.
    """
    import torch

    copies: list[Any] = []
    try:
        for handle in handles:
            device = handle[0]
            if device >= torch.cuda.device_count():
                raise RuntimeError(f"the kernel has no cuda:{device}")
            opened = _open(handle)
            copies.append(own_copy(opened, device))
            del opened  # released: rank 0's memory is free to go once the kernel answers
    except BaseException:
        copies.clear()
        raise
    return copies


def release(handles: Iterable[Handle]) -> None:
    """The exporter's own share of torch's IPC count, given back once no consumer can be left."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for handle in handles:
        try:
            torch.UntypedStorage._release_ipc_counter_cuda(handle[4], handle[5])  # private API: see taas_magic/private.py
        except Exception:  # noqa: BLE001 - best effort, as torch's own release is
            pass


def forget_counters(handles: Iterable[Handle]) -> None:
    """Rank 0, about to exit with ``os._exit``: remove torch's IPC ref-counter files it made
    (``/dev/shm/torch_<pid>_...``), which only its destructors would have removed."""
    for name in {handle[4] for handle in handles if isinstance(handle[4], bytes)}:
        try:
            os.unlink(os.path.join(SHM, name.decode().lstrip("/")))
        except (OSError, UnicodeDecodeError):
            pass
