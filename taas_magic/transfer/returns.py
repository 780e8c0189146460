"""What rank 0 sends back: the names its cell bound or changed, and its final value.

Runs in each rank, on its main thread: every rank notes its names before the cell, rank 0 sends them
after it.

Before the cell, every rank notes the identity of every name in its namespace (so every rank
knows the names its cell bound, which the ranks gather whole when they are sharded:
transfer/sharded.py). After it, rank 0 pickles once (transfer/pack.py), in this order: every
shipped value as the kernel shipped it (the object it received, whatever name holds it now),
then the names that are new or rebound, then the final value. Because the shipped values
come first and in the kernel's order, a shipped value the cell did not touch pickles to the
very bytes the kernel sent: its segment's digest equals the one the kernel vouched for, and each
tensor it holds is still the shipped storage with the same bytes: no page of it was
written (the page map of the copy-on-write mapping says so at once), or else its bytes
equal the kernel's file (never pickled again). Such a value is not sent back, and the notebook
keeps its own object. Everything else comes back, so ``model.train()`` or
``history.append(...)`` on a notebook value returns too; a shipped name the cell
deleted is deleted in the notebook.

What the notebook receives keeps its references: a value that reaches an object of an
untouched shipped value (``opt = SGD(model.parameters())``) brings that value back too,
so ``opt`` still holds ``model``'s parameters. A tensor whose bytes the cell did not
change is not copied back at all: the kernel builds it on its own storage.

A name that cannot be pickled is listed and the rest come back; a DDP or compiled
wrapper comes back as its module (transfer/unwrap.py). The bytes travel in one memory
file the kernel maps (transfer/memfile.py), named for the kernel's pid and the run.

When the run offers CUDA IPC (``RunSpec.cuda_ipc``), CUDA storages travel as IPC handles
instead (transfer/cudaipc.py): the kernel copies them device to device while rank 0
waits (:func:`await_kernel`), its storages alive, for ``Released``, or for ``SendHost``,
on which :meth:`Returns.message` writes them to the memory file after all.
"""

from __future__ import annotations

import array
import ctypes
import dataclasses
import mmap
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from taas_magic.protocol import ToKernel, ToPeer
from taas_magic.runspec import RunSpec
from taas_magic.transfer import cudaipc, memfile
from taas_magic.transfer.handoff import ReceivedClosure, segment_digests
from taas_magic.transfer.pack import Packing, Segment, pack
from taas_magic.transfer.unpack import FINAL


# -- this feature's frames (protocol.py frames them, and lists every frame) --------------------
@dataclass(frozen=True)
class Released(ToPeer, kind="released"):
    """The kernel has its copies of rank 0's CUDA storages: rank 0 may let them go."""


@dataclass(frozen=True)
class SendHost(ToPeer, kind="send-host"):
    """The kernel could not copy rank 0's CUDA storages: send the result again through host memory."""

    why: str


@dataclass(frozen=True)
class Result(ToKernel, kind="result"):
    """What rank 0's cell bound (transfer/returns.py); the kernel fills ``made`` and ``cuda_ipc`` (transfer/results.py)."""

    skeleton: bytes
    segments: list  # transfer.pack.Segment per name
    failed: list  # (name, type, reason) of names that could not be pickled
    deleted: list[str]
    places: list  # per blob: ("at", offset, size), ("kept", j), ("ipc", k), ("made", k), ("none",), None
    data: Any  # transfer.memfile.BlobData
    ipc: list  # CUDA IPC handles, ("ipc", k) is ipc[k]
    cuda_host: tuple[int, int, str]  # CUDA storages sent through host memory: count, bytes, why
    made: tuple = ()  # the kernel's copies of the ipc storages, ("made", k) is made[k]
    cuda_ipc: tuple[int, int] = (0, 0)  # what came device to device: count, bytes
    kept_back: tuple = ()  # (name, type, bytes) of kept cells' names left on the ranks until touched (RunSpec.lazy_bytes)


_ABSENT = object()
SHIPPED = "<shipped {}>"  # a shipped object its name no longer holds: loaded if something reaches it, never bound


def snapshot(namespace: dict[str, Any]) -> dict[str, int]:
    return {name: id(value) for name, value in namespace.items()}


def changed_names(namespace: dict[str, Any], before: dict[str, int], private: set[str]) -> tuple[list[str], list[str]]:
    """Names bound to a new object (or new names), and names the cell deleted."""
    changed = [
        name for name, value in namespace.items()
        if name not in private and not name.startswith("__") and before.get(name) != id(value)
    ]
    deleted = [name for name in before if name not in namespace and name not in private]
    return changed, deleted


def _pages_untouched(address: int, nbytes: int) -> bool:
    """Whether this process wrote none of the pages under ``[address, address + nbytes)`` of a
    private file mapping: each is absent or still the file's own page (``/proc/self/pagemap``:
    bit 63 present, bit 61 file page; a page written copy-on-write turns anonymous). False
    whenever that cannot be read, so the caller compares the bytes instead."""
    if nbytes == 0:
        return True
    first = address // mmap.PAGESIZE
    count = (address + nbytes - 1) // mmap.PAGESIZE - first + 1
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first * 8)
            entries = array.array("Q", pagemap.read(count * 8))
    except (OSError, ValueError):
        return False
    present, swapped, file_page = 1 << 63, 1 << 62, 1 << 61
    return len(entries) == count and not any(
        entry & swapped or (entry & present and not entry & file_page) for entry in entries
    )


def _equal_bytes(address: int, original: Any, offset: int, nbytes: int) -> bool:
    if nbytes == 0:
        return True
    current = (ctypes.c_char * nbytes).from_address(address)
    before = memoryview(original)[offset:offset + nbytes]
    if "torch" in sys.modules:
        import torch

        with warnings.catch_warnings():  # the kernel's file is mapped read-only: nothing writes through it
            warnings.simplefilter("ignore")
            return torch.equal(torch.frombuffer(current, dtype=torch.uint8), torch.frombuffer(before, dtype=torch.uint8))
    import numpy

    return bool(numpy.array_equal(numpy.frombuffer(memoryview(current), numpy.uint8), numpy.frombuffer(before, numpy.uint8)))


class _Shipped:
    """Which of rank 0's blobs are a shipped blob whose bytes the cell left alone."""

    def __init__(self, received: ReceivedClosure, packing: Packing):
        data = received.data
        base = received.base_address()
        kinds = received.message.kinds
        self._at = {(kinds[j], base + offset): j for j, offset in enumerate(data.offsets)}
        self._data = data
        self._received = received
        self._original: Any = None
        self._blobs = packing.blobs
        self._untouched: dict[int, int | None] = {}

    def origin(self, index: int) -> int | None:
        """The shipped blob that rank 0's blob ``index`` lies on (same place, same size), if any."""
        blob = self._blobs[index]
        if blob.address is None:
            return None
        j = self._at.get((blob.kind, blob.address))
        return j if j is not None and self._data.sizes[j] == blob.nbytes else None

    def untouched(self, index: int) -> int | None:
        """The shipped blob that rank 0's blob ``index`` is, with its bytes unchanged, if any."""
        if index not in self._untouched:
            j = self.origin(index)
            address, nbytes = self._blobs[index].address, self._blobs[index].nbytes
            if j is not None and address is not None and not (self._data.path is not None and _pages_untouched(address, nbytes)):
                if self._original is None:
                    self._original = self._received.original_bytes()
                if self._original is None or not _equal_bytes(address, self._original, self._data.offsets[j], nbytes):
                    j = None
            self._untouched[index] = j
        return self._untouched[index]


def _decide(packing: Packing, received: ReceivedClosure, shipped: _Shipped) -> list[bool | None]:
    """Per segment, whether the kernel binds it; None for a segment it need not even load."""
    digests = received.message.digests
    now = segment_digests(packing)
    bind = []
    for segment in packing.segments:
        digest = digests.get(segment.name)
        if digest is None:  # new, rebound, the final value, or a shipped object no name holds now
            bind.append(not segment.name.startswith("<shipped "))
        else:
            same_pickle = now[segment.name] == digest
            bind.append(not (same_pickle and all(shipped.untouched(i) == i for i in segment.blobs)))
    needed: list[bool | None] = [True if each else None for each in bind]
    for k in range(len(packing.segments) - 1, -1, -1):
        if needed[k] is None:
            continue
        for d in packing.segments[k].deps:  # what a loaded segment reaches must come back with it
            if needed[d] is None:
                needed[d] = bind[d] = packing.segments[d].name in digests
    return [bind[k] if needed[k] is not None else None for k in range(len(bind))]


def _deferred(packing: Packing, decisions: Sequence[bool | None], changed: Sequence[str], lazy_bytes: int) -> frozenset[int]:
    """The segments of the names a kept cell leaves on the ranks: each one the cell bound whose tensors and arrays
    hold ``lazy_bytes`` or more, unless a value that does come back reaches it (it would be loaded anyway)."""
    if lazy_bytes <= 0:
        return frozenset()
    names = set(changed)
    deferred: set[int] = set()
    reached: set[int] = set()
    for k in range(len(packing.segments) - 1, -1, -1):  # a segment reaches only earlier ones
        segment = packing.segments[k]
        nbytes = sum(packing.blobs[i].nbytes for i in segment.blobs)
        if segment.name in names and decisions[k] and nbytes >= lazy_bytes and k not in reached:
            deferred.add(k)
        elif decisions[k] is not None:
            reached |= segment.deps
    return frozenset(deferred)


def _places(packing: Packing, included: Sequence[Segment], bound: Sequence[bool], shipped: _Shipped) -> tuple[list, list[int]]:
    """Each blob's place for the kernel (its own ``("kept", j)``, or to be written), and those to write."""
    used = set().union(*(segment.blobs for segment in included)) if included else set()
    used_by_bound = set().union(*(s.blobs for s, b in zip(included, bound) if b)) if included else set()
    places: list[Any] = []
    to_write = []
    for index in range(len(packing.blobs)):
        if index not in used:
            places.append(("none",))
            continue
        j = shipped.untouched(index)
        if j is None and index not in used_by_bound:
            j = shipped.origin(index)  # only unbound objects use it: its size is all that matters
        if j is not None:
            places.append(("kept", j))
        else:
            places.append(None)
            to_write.append(index)
    return places, to_write


@dataclass
class Returns:
    """Rank 0's results, packed and decided; kept until the kernel has them (the packing holds every
    storage it exported, so they stay alive)."""

    packing: Packing
    head: dict  # the message without its blobs' places: skeleton, segments, failed, deleted
    places: list  # per blob: ("kept", j), ("none",), or None (its bytes must go to the kernel)
    to_write: list[int]  # the blobs whose bytes the kernel needs
    spec: RunSpec

    def message(self, cuda_ipc: bool, why: str = "") -> Result:
        """The ``Result`` frame. With ``cuda_ipc``, CUDA storages as IPC handles (``("ipc", k)``:
        ``message.ipc[k]``); every other blob written once to the memory file, or inline.
        ``cuda_host`` counts the CUDA storages in host memory and says why (``why``, or why exporting failed)."""
        blobs = self.packing.blobs
        handles, failed = cudaipc.export(blobs, self.to_write) if cuda_ipc else ({}, "")
        host = [index for index in self.to_write if index not in handles]
        spec = self.spec
        data = memfile.write([blobs[i] for i in host], memfile.RESULT_PREFIX, spec.kernel_pid, spec.run_id,
                             spec.result_file_bytes)
        places = list(self.places)
        for position, index in enumerate(host):
            places[index] = ("at", data.offsets[position], data.sizes[position])
        for k, index in enumerate(handles):
            places[index] = ("ipc", k)
        count, nbytes = cudaipc.tally(blobs, host)
        return Result(**self.head, places=places, data=data, ipc=list(handles.values()),
                      cuda_host=(count, nbytes, why or failed))


@dataclass(frozen=True)
class CellResults:
    """What rank 0's cell left to send back: its namespace, the names it bound or changed and
    those it deleted (:func:`changed_names`), and its final value when it has one to show; the
    gather of sharded names (transfer/sharded.py) adds what it says of each, and those it left out."""

    namespace: dict[str, Any]
    changed: list[str]
    deleted: list[str]
    final: Any = None
    has_final: bool = False  # False: no last expression, or the cell ends with ";"
    notes: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)  # name -> (its type in the rank, a line)
    failed: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (name, type, why): not sent


def _noted(segment: Segment, notes: dict[str, tuple[str, str]]) -> Segment:
    """``segment`` with its type and note as the gather of sharded names said them (none: as packed)."""
    if segment.name not in notes:
        return segment
    type_name, note = notes[segment.name]
    return dataclasses.replace(segment, type_name=type_name, note=note)


def pack_returns(results: CellResults, closure: dict[str, Any], received: ReceivedClosure,
                 loaders: Sequence[Any], spec: RunSpec) -> Returns:
    """What the kernel must load and bind of ``results``, given the ``closure`` as loaded from what
    the rank ``received`` (``loaders``: the registered loaders, by index); :meth:`Returns.message`
    is the ``Result`` frame."""
    namespace = results.namespace
    left_out = {name for name, _, _ in results.failed}
    items = [(name if namespace.get(name, _ABSENT) is closure[name] else SHIPPED.format(name), closure[name])
             for name in received.names if name not in left_out]
    items += [(name, namespace[name]) for name in results.changed]
    if results.has_final:
        items.append((FINAL, results.final))
    packing = pack(items, loaders, unwrap=True, track=True)
    shipped = _Shipped(received, packing)
    decisions = _decide(packing, received, shipped)
    deferred = _deferred(packing, decisions, results.changed, spec.lazy_bytes if spec.keep else 0)
    kept_back = [(packing.segments[k].name, packing.segments[k].type_name,
                  sum(packing.blobs[i].nbytes for i in packing.segments[k].blobs)) for k in sorted(deferred)]
    if kept_back:  # packed again without them: the skeleton the kernel loads holds none of their objects
        left = {name for name, _, _ in kept_back}
        packing = pack([item for item in items if item[0] not in left], loaders, unwrap=True, track=True)
        shipped = _Shipped(received, packing)
        decisions = _decide(packing, received, shipped)
    last = max((k for k, bind in enumerate(decisions) if bind is not None), default=-1)
    included = packing.segments[: last + 1]
    bound = [bool(decisions[k]) for k in range(last + 1)]
    places, to_write = _places(packing, included, bound, shipped)
    head = {
        "skeleton": packing.skeleton[: included[-1].end] if included else b"",
        "segments": [_noted(dataclasses.replace(segment, bind=b), results.notes) for segment, b in zip(included, bound)],
        "failed": [*results.failed, *packing.failed],
        "deleted": results.deleted,
        "kept_back": tuple(kept_back),
    }
    return Returns(packing, head, places, to_write, spec)


def await_kernel(take: Callable[..., Any], seconds: float = cudaipc.RELEASE_SECONDS) -> str | None:
    """Rank 0, having sent CUDA IPC handles: wait (its storages alive) until the kernel has its copies.

    ``take``: the rank's inbox's (rank/inbox.py). Returns None once the kernel says ``Released``
    or closes the connection (it is gone: its stop ladder ends this rank anyway); why the bytes
    must go through host memory instead when the kernel asks for that (``SendHost``) or does not
    answer within ``seconds``. Anything else (a delivery for a loader the cell no longer reads)
    is not what we wait for.
    """
    try:
        frame = take(lambda frame: isinstance(frame, (Released, SendHost)), seconds)
    except OSError:
        return None
    match frame:
        case None:
            return f"the kernel did not answer within {seconds:g} s"
        case SendHost(why=why):
            return why
    return None
