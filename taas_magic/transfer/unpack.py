"""Load a packing's segments: tensors and arrays built on the blob bytes, failures kept to their names.

Runs wherever a packing is loaded: in each rank (the closure, on its main thread) and in the kernel
(rank 0's names, on the cell's thread that binds them).

Contract:

- :class:`Blobs` turns a blob's persistent id into a storage or array *on* the bytes it
  is given (a mapped file, or the frame's buffer): no copy. A blob placed ``("kept", j)``
  is the receiver's own ``j``-th blob of what it sent (rank 0 sends back only where a
  shipped tensor's bytes are unchanged, so the notebook keeps its own storage); one placed
  ``("made", k)`` is ``made[k]``, a storage the receiver already holds (a device copy
  made by CUDA IPC, cudaipc.py). A CUDA storage lands on the same device when this
  process has it, else on the CPU; with ``own_gpu`` (a rank bound to its GPU) on that GPU.
- :func:`load` loads the segments in order with one unpickler (one memo, so shared
  objects stay shared). If any segment raises, it loads them all again with a
  recovering unpickler: a failing segment is listed, every memo slot it fills (or would
  have) holds a placeholder instead, and a later segment that reaches a placeholder fails too, naming the
  segment it shares an object with. Every other value arrives.
- A ``FutureWarning`` or ``DeprecationWarning`` raised while loading (a library's
  ``__setstate__`` using a deprecated helper) is not shown: the sender already built
  that value, and the person did not write the code that warns here.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import sys
import warnings
from typing import Any, Callable, Sequence

from taas_magic.transfer.pack import Blob, Segment

FINAL = "<final value>"  # the segment holding the cell's final expression
Resolve = Callable[[Any], Any]
Failed = tuple[str, str, str]  # (name, type, reason) of a value that could not be loaded
_MEMO_PUTS = {"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"}


def _device_here(device: str) -> str:
    if not device.startswith("cuda"):
        return "cpu"
    torch = sys.modules["torch"]
    index = int(device.split(":")[1]) if ":" in device else 0
    return device if torch.cuda.is_available() and index < torch.cuda.device_count() else "cpu"


def target_device(device: str, own_gpu: bool) -> str:
    """Where a storage that was on ``device`` lands here (``own_gpu``: a rank bound to its GPU)."""
    if own_gpu and device.startswith("cuda"):
        return f"cuda:{sys.modules['torch'].cuda.current_device()}"
    return _device_here(device)


def storage_on(buffer: Any, offset: int, nbytes: int, target: str) -> Any:
    """An untyped storage of ``nbytes`` at ``offset`` of ``buffer``: on it for the CPU, else copied to ``target``."""
    import torch

    flat = (torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
            if nbytes else torch.empty(0, dtype=torch.uint8))
    return (flat.to(target) if target != "cpu" else flat).untyped_storage()


class Blobs:
    """Blob index -> storage or array, built on ``buffer`` (``places[i]``: ``("at", offset, nbytes)``,
    ``("kept", j)``, the receiver's own ``kept[j]``, or ``("made", k)``, the storage ``made[k]``)."""

    def __init__(self, places: Sequence[tuple], buffer: Any, kept: Sequence[Blob] = (), made: Sequence[Any] = (),
                 own_gpu: bool = False):
        self._places = places
        self._buffer = buffer
        self._kept = kept
        self._made = made
        self._own_gpu = own_gpu
        self._storages: dict[int, Any] = {}
        self._arrays: dict[int, Any] = {}

    def _once(self, cache: dict[int, Any], index: int, build: Callable[[int, int], Any]) -> Any:
        """Blob ``index`` made once (so views of one storage stay views): the receiver's own
        source when kept, the storage given when made, else ``build(offset, nbytes)`` on the buffer."""
        made = cache.get(index)
        if made is None:
            place = self._places[index]
            if place[0] == "kept":
                made = self._kept[place[1]].source
            elif place[0] == "made":
                made = self._made[place[1]]
            else:
                made = build(place[1], place[2])
            cache[index] = made
        return made

    def storage(self, index: int, dtype: Any, device: str) -> Any:
        import torch

        def build(offset: int, nbytes: int) -> Any:
            return storage_on(self._buffer, offset, nbytes, target_device(device, self._own_gpu))

        untyped = self._once(self._storages, index, build)
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)

    def array(self, index: int, dtype: str, shape: tuple) -> Any:
        import numpy

        def build(offset: int, nbytes: int) -> Any:
            if not nbytes:
                return numpy.empty(shape, dtype)
            flat = numpy.frombuffer(self._buffer, dtype=numpy.uint8, count=nbytes, offset=offset)
            return flat.view(numpy.dtype(dtype)).reshape(shape)

        return self._once(self._arrays, index, build)


def resolver(blobs: Blobs, externals: Callable[[int], Any] | None = None) -> Resolve:
    def resolve(pid: Any) -> Any:
        kind = pid[0]
        if kind == "s":
            return blobs.storage(*pid[1:])
        if kind == "n":
            return blobs.array(*pid[1:])
        if kind == "taas-feed" and externals is not None:
            return externals(pid[1])
        raise pickle.UnpicklingError(f"unknown reference in the pickle: {pid!r}")

    return resolve


class _Missing:
    """Stands in the memo for the objects of a segment that failed to load."""

    def __init__(self, name: str):
        self.name = name


class _SharesFailed(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _checked(load_get: Callable[[Any], None]) -> Callable[[Any], None]:
    def load(self: Any) -> None:
        load_get(self)
        if isinstance(self.stack[-1], _Missing):
            raise _SharesFailed(self.stack[-1].name)

    return load


# The pure-Python unpickler: its memo is a dict we may fill, and its opcodes are methods we may wrap.
# private API: see taas_magic/private.py
_PythonUnpickler: Any = getattr(pickle, "_Unpickler")  # noqa: B009 - private: typeshed does not declare it


class _RecoveringUnpickler(_PythonUnpickler):
    dispatch = dict(_PythonUnpickler.dispatch)
    for _opcode, _method in ((pickle.GET, "load_get"), (pickle.BINGET, "load_binget"), (pickle.LONG_BINGET, "load_long_binget")):
        dispatch[_opcode[0]] = _checked(getattr(_PythonUnpickler, _method))

    def __init__(self, file: io.BytesIO, resolve: Resolve):
        super().__init__(file)
        self.persistent_load = resolve


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, resolve: Resolve):
        super().__init__(file)
        self._resolve = resolve

    def persistent_load(self, pid: Any) -> Any:
        return self._resolve(pid)


def _memo_puts(segment: bytes) -> int:
    return sum(1 for opcode, _, _ in pickletools.genops(segment) if opcode.name in _MEMO_PUTS)


def _load_fast(skeleton: bytes, segments: Sequence[Segment], resolve: Resolve) -> dict[str, Any]:
    unpickler = _Unpickler(io.BytesIO(skeleton), resolve)
    return {segment.name: unpickler.load() for segment in segments}


def _load_recovering(skeleton: bytes, segments: Sequence[Segment], resolve: Resolve) -> tuple[dict[str, Any], list[Failed]]:
    stream = io.BytesIO(skeleton)
    unpickler = _RecoveringUnpickler(stream, resolve)
    values: dict[str, Any] = {}
    failed: list[tuple[str, str, str]] = []
    start = 0
    for segment in segments:
        stream.seek(start)
        before = len(unpickler.memo)
        try:
            values[segment.name] = unpickler.load()
        except _SharesFailed as shared:
            failed.append((segment.name, segment.type_name, f"shares an object with {shared.name}, which could not be loaded"))
        except Exception as exc:  # noqa: BLE001 - unpickling can raise anything (a __setstate__, a missing module)
            failed.append((segment.name, segment.type_name, f"{type(exc).__name__}: {exc}".splitlines()[0]))
        else:
            start = segment.end
            continue
        # Whatever the segment built before it failed is half-made: nothing may reach it.
        for index in range(before, before + _memo_puts(skeleton[start:segment.end])):
            unpickler.memo[index] = _Missing(segment.name)
        start = segment.end
    return values, failed


def load(skeleton: bytes, segments: Sequence[Segment], resolve: Resolve) -> tuple[dict[str, Any], list[Failed]]:
    """Every segment's value by name, and (name, type, reason) for each that could not be loaded."""
    with warnings.catch_warnings():  # the sender built these values already: its libraries' deprecations are not news
        for category in (FutureWarning, DeprecationWarning, PendingDeprecationWarning):
            warnings.simplefilter("ignore", category)
        try:
            return _load_fast(skeleton, segments, resolve), []
        except Exception:  # noqa: BLE001 - find out which segments, and keep the rest
            return _load_recovering(skeleton, segments, resolve)
