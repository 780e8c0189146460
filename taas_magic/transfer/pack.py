"""Pickle named values as segments of one stream, with tensor and array bytes out of band.

Runs in the kernel (the closure, packed in a run's plan step) and in rank 0 (its names, after the
cell, on its main thread).

Contract:

- ``pack(items)`` pickles each ``(name, value)`` in order with one cloudpickle pickler
  (protocol 5). Segment ``k`` is the bytes ``skeleton[segments[k-1].end:segments[k].end]``;
  loading the segments in order with one unpickler rebuilds every value, and an object
  reached from two names is one object afterwards (one memo).
- Every torch storage (whatever device) and every C-contiguous numpy array of plain
  dtype is a *blob*: the stream holds only ``("s", index, dtype, device)`` or
  ``("n", index, dtype, shape)``; a storage shared by several tensors (views, tied
  weights, an optimizer's reference to a parameter) is one blob. Nothing is copied here:
  a :class:`Blob` keeps a reference to where the bytes are.
- A value that raises while pickling is left out, with its name, type and reason in
  ``failed``, and the other values are pickled again without it: one bad name never
  costs the others.
- ``externals`` (registered loaders, or a rank's prepared loaders) travel as
  ``("taas-feed", i)`` and are resolved by the receiver.
- With ``unwrap=True`` (rank 0's results) a wrapper (unwrap.py) travels as its module.
- With ``track=True`` each segment also lists the earlier segments whose objects it
  reaches again (``deps``), so the sender can tell whether leaving a segment unbound in
  the receiver would split an object in two.
"""

from __future__ import annotations

import io
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Sequence

from taas_magic.transfer.pickler import Pickler
from taas_magic.transfer.unwrap import same, unwrap

# Objects whose identity never matters across names (immutable, or pickled by reference).
_NO_IDENTITY = frozenset((
    type(None), bool, int, float, complex, str, bytes, type,
    types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.MethodType,
))


_IDENTITY_BY_CLASS: dict[type, bool] = {}


def _has_identity(cls: type) -> bool:
    """Whether a person could see two copies of such an object as two: a mutable container, or
    an instance with attributes (a tensor, a module, an optimizer), never a class or a dtype."""
    known = _IDENTITY_BY_CLASS.get(cls)
    if known is None:
        known = _IDENTITY_BY_CLASS[cls] = (
            issubclass(cls, (list, dict, set, bytearray)) or (cls.__dictoffset__ != 0 and not issubclass(cls, type))
        )
    return known


@dataclass
class Blob:
    """One out-of-band payload: a torch storage or a numpy array, and where its bytes are."""

    kind: str  # "s": a torch storage, "n": a numpy array
    source: Any
    nbytes: int
    address: int | None  # None: not in this process's memory (a CUDA storage)

    def cpu_bytes(self) -> memoryview:
        """The payload as bytes in host memory (a CUDA storage is copied to the host once).

        A blob whose ``nbytes`` is 0 is empty, whatever its source (a blob that travels another
        way, such as CUDA IPC, keeps its place in the file at no size).
        """
        if not self.nbytes:
            return memoryview(b"")
        if self.kind == "n":
            return self.source.reshape(-1).view("uint8").data
        import torch

        flat = torch.empty(0, dtype=torch.uint8, device=self.source.device).set_(self.source)
        return flat.cpu().numpy().data


@dataclass(frozen=True)
class Segment:
    name: str
    type_name: str
    end: int  # offset in the skeleton just past this segment
    blobs: frozenset[int] = frozenset()  # blob indices the segment refers to
    deps: frozenset[int] = frozenset()  # earlier segments whose objects it reaches (track=True)
    note: str = ""  # e.g. "came back as its module"
    bind: bool = True  # whether the receiver binds the value to ``name`` (else it only loads it)


@dataclass
class Packing:
    skeleton: bytes
    segments: list[Segment]
    blobs: list[Blob]
    externals_used: set[int] = field(default_factory=set)  # indices of the externals reached
    failed: list[tuple[str, str, str]] = field(default_factory=list)  # (name, type, reason)


def type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _numpy_ndarray() -> type:
    numpy = sys.modules.get("numpy")
    return numpy.ndarray if numpy is not None else type(None)


class _Pickler(Pickler):
    def __init__(self, file: io.BytesIO, externals: Sequence[Any], unwrap: bool, track: bool):
        super().__init__(file, protocol=5)
        self._externals = {id(obj): index for index, obj in enumerate(externals)}
        self._unwrap = unwrap
        self._track = track
        self.blobs: list[Blob] = []
        self._blob_index: dict[int, int] = {}  # storage _cdata or id(array) -> blob index
        self._keep: list[Any] = []  # every object whose id is a key here stays alive while we pickle
        self._first_seen: dict[int, int] = {}  # id(obj) -> segment that first reached it
        self.externals_used: set[int] = set()
        self.segment = 0
        self.segment_blobs: set[int] = set()
        self.segment_deps: set[int] = set()

    def _blob(self, key: int, kind: str, source: Any, nbytes: int, address: int | None) -> int:
        index = self._blob_index.get(key)
        if index is None:
            index = self._blob_index[key] = len(self.blobs)
            self.blobs.append(Blob(kind, source, nbytes, address))
            self._keep.append(source)
        self.segment_blobs.add(index)
        return index

    def persistent_id(self, obj: Any) -> Any:
        cls = type(obj)
        if cls in _NO_IDENTITY:
            return None
        if self._track and _has_identity(cls):
            first = self._first_seen.setdefault(id(obj), self.segment)
            if first == self.segment:
                self._keep.append(obj)
            else:
                self.segment_deps.add(first)
        external = self._externals.get(id(obj))
        if external is not None:
            self.externals_used.add(external)
            return ("taas-feed", external)
        torch = sys.modules.get("torch")
        if torch is not None and cls is torch.storage.TypedStorage:
            untyped = obj._untyped_storage  # private API: see taas_magic/private.py (and _cdata)
            address = untyped.data_ptr() if untyped.device.type == "cpu" else None
            index = self._blob(untyped._cdata, "s", untyped, untyped.nbytes(), address)
            return ("s", index, obj.dtype, str(untyped.device))
        if cls is _numpy_ndarray() and obj.flags.c_contiguous and obj.dtype.fields is None and not obj.dtype.hasobject:
            index = self._blob(id(obj), "n", obj, obj.nbytes, obj.__array_interface__["data"][0])
            return ("n", index, obj.dtype.str, obj.shape)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if self._unwrap:
            inner = unwrap(obj)
            if inner is not None:
                return same, (inner[0],)
        return super().reducer_override(obj)  # private API: see taas_magic/private.py


class _ItemFailed(Exception):
    def __init__(self, position: int, reason: str):
        super().__init__(reason)
        self.position = position
        self.reason = reason


def _note(value: Any, unwrapping: bool) -> str:
    if not unwrapping:
        return ""
    inner = unwrap(value)  # raises for a sharded FSDP: the pickle reports it
    return "came back as its module" if inner is not None else ""


def _pack_all(items: list[tuple[str, Any]], externals: Sequence[Any], unwrapping: bool, track: bool) -> Packing:
    buffer = io.BytesIO()
    pickler = _Pickler(buffer, externals, unwrapping, track)
    segments = []
    for position, (name, value) in enumerate(items):
        pickler.segment, pickler.segment_blobs, pickler.segment_deps = position, set(), set()
        try:
            note = _note(value, unwrapping)
            pickler.dump(value)
        except Exception as exc:  # noqa: BLE001 - pickling can fail with any exception type
            raise _ItemFailed(position, f"{type(exc).__name__}: {exc}".splitlines()[0]) from None
        segments.append(Segment(name, type_name(value), buffer.tell(), frozenset(pickler.segment_blobs),
                                frozenset(pickler.segment_deps), note))
    return Packing(buffer.getvalue(), segments, pickler.blobs, pickler.externals_used)


def pack(items: Sequence[tuple[str, Any]], externals: Sequence[Any] = (), *, unwrap: bool = False,
         track: bool = False) -> Packing:
    """Pickle ``items`` in order as segments; leave out (and list) the ones that cannot be pickled."""
    remaining = list(items)
    failed = []
    while True:
        try:
            packing = _pack_all(remaining, externals, unwrap, track)
        except _ItemFailed as bad:
            name, value = remaining.pop(bad.position)
            failed.append((name, type_name(value), bad.reason))
            continue
        packing.failed = failed
        return packing
