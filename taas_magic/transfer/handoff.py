"""How the closure reaches the ranks: its pickle in the frame, its tensor bytes in one shared map.

Runs in the kernel (the closure packed and written in a run's plan step; a rank's
``ClosureHostWanted`` answered on the run's own thread) and in each rank (:class:`ReceivedClosure`,
on its main thread).

The kernel pickles the closure once (transfer/pack.py) and writes the tensor and array
bytes once (transfer/memfile.py): below ``HANDOFF_BYTES`` inside the ``closure`` frame,
above it to one owner-only file in ``/dev/shm`` that every rank maps copy-on-write, so a
rank that changes a captured tensor in place changes only its own pages, and the pages
it only reads exist once for all ranks. The authenticated frame carries the pickle, the
blobs' places, one digest per name (what rank 0 compares against to see whether a
shipped value changed in place) and a digest per chunk of the file, which a rank checks
before it builds anything on those bytes.

The kernel keeps its :class:`~taas_magic.transfer.pack.Packing` until the cell's results
are in: rank 0 refers to a shipped blob whose bytes it did not change, and the kernel
resolves that to its own storage. The file is removed when the cell ends and swept by a
later run if the kernel was killed first.

With ``cuda_ipc`` (the ranks share this host and the kernel has CUDA: transfer/cudaipc.py)
the kernel's CUDA tensors are not written to the file: the frame carries their CUDA IPC
handles, each keeping its place in the file at no size. Each rank opens them as soon as
the frame arrives and, once bound to its GPU, copies them onto it (:meth:`ReceivedClosure.load`).
A rank that cannot open them sends a ``ClosureHostWanted`` frame; the run's handoff answers it
(:meth:`ClosureHandoff.answer_host_copy`, which the supervisor is given with the run's parts): it
writes those tensors to one more memory file the first time it is asked and answers every rank
that asks with it, until the cell ends and :meth:`ClosureHandoff.remove` lets them go.
:func:`closure_route` says in words which way the bytes travel, for the header.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from taas_magic import protocol
from taas_magic.protocol import Hold, PeerChannel, ToKernel, ToPeer
from taas_magic.transfer import cudaipc, memfile, unpack
from taas_magic.transfer.pack import Packing


# -- this feature's frames (protocol.py frames them, and lists every frame) --------------------
@dataclass(frozen=True)
class Closure(ToPeer, kind="closure"):
    """The closure (transfer/handoff.py): its pickle, and where the bytes of its blobs are."""

    skeleton: bytes
    segments: list  # transfer.pack.Segment per name
    digests: dict[str, bytes]  # name -> SHA-256 of its segment of the pickle
    kinds: list[str]  # per blob
    data: Any  # transfer.memfile.BlobData: inline, or a memory file with its digests
    ipc: dict  # blob index -> CUDA IPC handle (transfer/cudaipc.py)
    run: str  # the run id (a rank names it when it asks for the host copy)


@dataclass(frozen=True)
class ClosureHostCopy(ToPeer, kind="closure-host-copy"):
    """The closure's CUDA tensors in one memory file (``data``), or why there is none (``error``)."""

    data: Any = None  # transfer.memfile.BlobData
    error: str = ""


@dataclass(frozen=True)
class ClosureHostWanted(ToKernel, kind="closure-host"):
    run: str
    why: str  # why the CUDA IPC handles did not open in this rank


HANDOFF_BYTES = memfile.INLINE_BYTES


def segment_digests(packing: Packing) -> dict[str, bytes]:
    """SHA-256 of each name's segment of the pickle."""
    digests, start = {}, 0
    for segment in packing.segments:
        digests[segment.name] = hashlib.sha256(packing.skeleton[start:segment.end]).digest()
        start = segment.end
    return digests


def closure_route(packing: Packing, cuda_ipc: bool, threshold: int = HANDOFF_BYTES) -> str:
    """How the closure's tensor bytes reach the ranks, for the header: "CUDA IPC", "one shared
    file", both joined by " + ", or "" (inside the frame)."""
    device = {i for i, blob in enumerate(packing.blobs) if cuda_ipc and cudaipc.is_cuda(blob) and blob.nbytes}
    host_bytes = memfile.layout([0 if i in device else blob.nbytes for i, blob in enumerate(packing.blobs)])[1]
    return " + ".join((["CUDA IPC"] if device else []) + (["one shared file"] if host_bytes >= threshold else []))


class ClosureHandoff:
    """The kernel's side: the frame body to send each rank, the host copy of its CUDA tensors for
    the ranks that ask, and the files to remove."""

    def __init__(self, packing: Packing, run_id: str, threshold: int = HANDOFF_BYTES, cuda_ipc: bool = False):
        self.packing = packing
        self.run_id = run_id
        self.threshold = threshold
        self.host: memfile.BlobData | None = None  # the exported tensors in host memory, once a rank asked
        self.handles: dict[int, cudaipc.Handle] = {}
        if cuda_ipc:
            self.handles, why = cudaipc.export(packing.blobs, range(len(packing.blobs)))
            if why:
                count, nbytes = cudaipc.tally(packing.blobs, [i for i in range(len(packing.blobs)) if i not in self.handles])
                print(f"taas: {count} CUDA tensor(s) of the closure, {cudaipc.size_text(nbytes)}, go through host memory "
                      f"({why})", file=sys.stderr)
        try:
            blobs = [dataclasses.replace(blob, nbytes=0) if i in self.handles else blob for i, blob in enumerate(packing.blobs)]
            self.data = memfile.write(blobs, memfile.CLOSURE_PREFIX, os.getpid(), run_id, threshold)
        except BaseException:
            cudaipc.release(self.handles.values())
            raise
        self.path = self.data.path
        frame = Closure(packing.skeleton, packing.segments, segment_digests(packing), [blob.kind for blob in packing.blobs],
                        self.data, self.handles, run_id)
        self.body = protocol.encode(frame)  # pickled once, sent to every rank

    def host_copy(self) -> memfile.BlobData:
        """The exported tensors (by index order) in one memory file, written the first time a rank asks."""
        if self.host is None:
            blobs = [self.packing.blobs[i] for i in sorted(self.handles)]
            self.host = memfile.write(blobs, memfile.CLOSURE_PREFIX, os.getpid(), self.run_id, self.threshold)
        return self.host

    def remove(self) -> None:
        """When the cell ends (its ranks are gone): the files, and the kernel's share of the IPC counts."""
        memfile.remove(self.path)
        self.path = None
        if self.host is not None:
            memfile.remove(self.host.path)
        cudaipc.release(self.handles.values())
        self.handles = {}

    def answer_host_copy(self, rank: int, request: ClosureHostWanted) -> tuple[bytes, str]:
        """The :class:`ClosureHostCopy` frame answering rank ``rank``, which could not open the
        closure's CUDA IPC handles, and the line that says so in the cell. An error frame once the
        cell ended (removed), or when this run exported none or the request names another run."""
        reason = request.why
        try:
            if request.run != self.run_id or not self.handles:
                raise LookupError("the kernel holds no CUDA tensors for this run")
            reply = ClosureHostCopy(data=self.host_copy())
            count, nbytes = cudaipc.tally(self.packing.blobs, self.handles)
            line = (f"taas: rank {rank} could not open the closure's CUDA tensors by CUDA IPC ({reason}); "
                    f"its {count} CUDA tensor(s), {cudaipc.size_text(nbytes)}, came through host memory")
        except Exception as exc:  # noqa: BLE001 - the rank reports it when it loads its closure
            reply = ClosureHostCopy(error=cudaipc.describe(exc))
            line = f"taas: rank {rank} could not open the closure's CUDA tensors by CUDA IPC ({reason}), nor get a host copy"
        return protocol.encode(reply), line


@dataclass
class ReceivedClosure:
    """The rank's side: what the kernel shipped, mapped and verified, ready to load."""

    message: Closure
    buffer: Any  # the mapped file (copy-on-write) or the frame's bytes
    pristine: bytes = b""  # a copy of small inline data, taken before the cell runs
    own_gpu: bool = False  # the rank binds its GPU before loading: CUDA tensors land there
    opened: dict[int, Any] = field(default_factory=dict)  # blob index -> the kernel's storage, mapped by CUDA IPC
    host: tuple[memfile.BlobData, Any] | None = None  # the kernel's host copy of those, when IPC failed here
    failure: str = ""  # why those tensors cannot be had at all (raised by load)
    made: dict[int, Any] | None = None  # blob index -> this rank's own copy (load makes them once)

    @property
    def data(self) -> memfile.BlobData:
        return self.message.data

    @property
    def names(self) -> list[str]:
        return [segment.name for segment in self.message.segments]

    def load(self, externals: Callable[[int], Any]) -> dict[str, Any]:
        """The closure's values by name (registered loaders resolved through ``externals``).

        Raises:
            pickle.UnpicklingError or whatever a value's unpickling raises, for the first name that fails.
        """
        places: list[tuple] = [("at", offset, size) for offset, size in zip(self.data.offsets, self.data.sizes)]
        made = self._device_tensors()
        for k, index in enumerate(made):
            places[index] = ("made", k)
        blobs = unpack.Blobs(places, self.buffer, made=list(made.values()), own_gpu=self.own_gpu)
        values, failed = unpack.load(self.message.skeleton, self.message.segments, unpack.resolver(blobs, externals))
        if failed:
            name, type_name, reason = failed[0]
            raise RuntimeError(f"{name} ({type_name}) could not be loaded in the rank: {reason}")
        return values

    def _device_tensors(self) -> dict[int, Any]:
        """The storages of the tensors that came by CUDA IPC, as this rank's own copies (by blob index)."""
        handles = self.message.ipc
        if self.made is None and handles:
            if self.failure:
                raise RuntimeError(f"the closure's CUDA tensors could not reach this rank: {self.failure}")
            order = sorted(handles)
            if self.host is not None:
                data, buffer = self.host
                self.made = {index: unpack.storage_on(buffer, data.offsets[k], data.sizes[k],
                                                      unpack.target_device(f"cuda:{handles[index][0]}", self.own_gpu))
                             for k, index in enumerate(order)}
            else:
                import torch

                here = torch.cuda.current_device() if self.own_gpu else None
                self.made = {index: cudaipc.own_copy(self.opened.pop(index), handles[index][0] if here is None else here)
                             for index in order}
        return self.made or {}

    def base_address(self) -> int:
        """Where the blob bytes start in this process (0 when there are none)."""
        if not self.data.size:
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))

    def original_bytes(self) -> Any:
        """The bytes as the kernel sent them, before the cell changed any in place."""
        if self.data.path is None:
            return self.pristine
        return memfile.original_view(self.data)


def _ask_host_copy(channel: PeerChannel, received: ReceivedClosure, why: str) -> None:
    """This rank could not open the CUDA IPC handles: the kernel's host copy instead (mapped and verified)."""
    channel.send(ClosureHostWanted(received.message.run, why))
    # nothing else comes before but a hold (another rank is in pdb: rank/cellpdb.py), which a rank that has
    # not started its cell has no process group to apply to
    reply = channel.receive()
    while isinstance(reply, Hold):
        reply = channel.receive()
    reply = protocol.expect(reply, ClosureHostCopy, "the closure's host copy")
    if reply.error:
        received.failure = f"CUDA IPC failed ({why}) and so did the host copy ({reply.error})"
        return
    received.host = (reply.data, memfile.open_data(reply.data, private=True))


def receive_closure(channel: PeerChannel, keep_original: bool = False, own_gpu: bool = False) -> ReceivedClosure:
    """Read the closure frame and map (and verify) its tensor bytes; nothing is unpickled yet.

    ``keep_original`` (rank 0): keep a copy of bytes that came in the frame, to tell later
    which the cell changed (a file's original stays in the file). ``own_gpu``: the rank binds
    its GPU before it loads the closure, and CUDA tensors land there. CUDA IPC handles are
    opened now (no copy yet); if they cannot be, the kernel's host copy is fetched now.

    Raises:
        wire.AuthenticationError: the file's bytes are not those the kernel vouched for.
    """
    message = protocol.expect(channel.receive(), Closure, "the closure")
    received = ReceivedClosure(message, memfile.open_data(message.data, private=True), own_gpu=own_gpu)
    if keep_original and message.data.path is None:
        received.pristine = bytes(received.buffer)
    if message.ipc:
        received.opened, why = cudaipc.open_all(message.ipc)
        if why:
            _ask_host_copy(channel, received, why)
    return received
