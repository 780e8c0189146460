"""One element as a record in a cache segment, and reading it back without a copy.

Runs in each data worker (writing records), in each rank (reading them on the cell's thread:
rank/loaders.py) and in a Ray host agent or Slurm task (publishing and mirroring them between
hosts).

A worker appends records to its own segment files (``os.pwrite``, no mmap needed)::

    record = "TAAS" | skeleton length (8) | record length (8) | skeleton | pad | buffers

The skeleton is the element pickled with every plain CPU tensor (and numpy array)
replaced by a persistent id ``(kind, offset, nbytes, dtype, shape, requires_grad)``;
the raw bytes of each follow, 64-byte aligned, so no tensor payload is ever pickled.

A rank maps each record copy-on-write (``MAP_PRIVATE``) and builds each tensor straight
on the mapping with ``torch.frombuffer``: no copy into the rank at all, and a cell that
changes a tensor in place changes only its own private pages, never the cache that
later passes replay. Records are immutable once the kernel has announced them.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
import sys
from typing import Any

MAGIC = b"TAAS"
HEADER = struct.Struct("<4sQQ")
ALIGN = 64


def aligned(offset: int) -> int:
    return (offset + ALIGN - 1) // ALIGN * ALIGN


def _raw_tensor(obj: Any) -> Any:
    """The uint8 view of a plain dense CPU tensor's data, or None to pickle it in-band."""
    torch = sys.modules.get("torch")
    if torch is None or type(obj) is not torch.Tensor:
        return None
    if obj.device.type != "cpu" or obj.layout != torch.strided or obj.is_quantized or obj.is_conj() or obj.is_neg():
        return None
    flat = obj.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)


def _raw_array(obj: Any) -> Any:
    numpy = sys.modules.get("numpy")
    if numpy is None or type(obj) is not numpy.ndarray or obj.dtype.hasobject:
        return None
    return numpy.ascontiguousarray(obj).reshape(-1).view(numpy.uint8)


class _SkeletonPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.buffers: list[Any] = []  # uint8 tensors / arrays, in offset order
        self.size = 0

    def _place(self, raw: Any, nbytes: int) -> int:
        offset = self.size
        self.buffers.append((offset, raw))
        self.size = aligned(offset + nbytes)
        return offset

    def persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        raw = _raw_tensor(obj)
        if raw is not None:
            nbytes = raw.numel()
            return ("t", self._place(raw, nbytes), nbytes, obj.dtype, tuple(obj.shape), obj.requires_grad)
        raw = _raw_array(obj)
        if raw is not None:
            nbytes = raw.size
            return ("n", self._place(raw, nbytes), nbytes, obj.dtype, obj.shape, False)  # the dtype whole: its fields too
        return None


def encode(element: Any) -> tuple[bytes, list[tuple[int, Any]], int]:
    """(head = header + skeleton, [(offset in payload, raw uint8 buffer)], record length)."""
    file = io.BytesIO()
    pickler = _SkeletonPickler(file)
    pickler.dump(element)
    skeleton = file.getvalue()
    payload_start = aligned(HEADER.size + len(skeleton))
    length = payload_start + pickler.size
    head = HEADER.pack(MAGIC, len(skeleton), length) + skeleton
    return head, [(payload_start + offset, raw) for offset, raw in pickler.buffers], length


def write(fd: int, at: int, head: bytes, buffers: list[tuple[int, Any]]) -> None:
    """Write an encoded record at offset ``at`` of ``fd`` (a pre-sized segment file)."""
    os.pwrite(fd, head, at)
    for offset, raw in buffers:
        data = raw.numpy() if hasattr(raw, "numpy") else raw
        if len(data):
            os.pwrite(fd, memoryview(data), at + offset)


def read_raw(path: str, offset: int) -> bytes:
    """One whole record's bytes, as stored (the cluster mode moves records between hosts
    verbatim: offsets inside a record are relative to its start, which is 64-byte aligned)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        magic, _, length = HEADER.unpack(os.pread(fd, HEADER.size, offset))
        if magic != MAGIC:
            raise ValueError(f"taas: no element record at {path}:{offset}")
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


class SegmentReader:
    """A rank's reads: each record mapped on its own, copy-on-write (``MAP_PRIVATE``).

    A mapping per record (not per segment) means a tensor the cell changes in place
    changes only its own private pages: the next read of that record, in a later
    replayed pass, sees the prepared bytes again.
    """

    def __init__(self) -> None:
        self._files: dict[str, int] = {}

    def _fd(self, path: str) -> int:
        fd = self._files.get(path)
        if fd is None:
            fd = self._files[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return fd

    def read(self, path: str, offset: int) -> Any:
        fd = self._fd(path)
        magic, skeleton_length, length = HEADER.unpack(os.pread(fd, HEADER.size, offset))
        if magic != MAGIC:
            raise ValueError(f"taas: no element record at {path}:{offset}")
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapped = mmap.mmap(fd, offset + length - start, offset=start, access=mmap.ACCESS_COPY)
        skeleton_at = offset - start + HEADER.size
        payload = offset - start + aligned(HEADER.size + skeleton_length)
        return _RecordUnpickler(mapped, payload, mapped[skeleton_at : skeleton_at + skeleton_length]).load()

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()


class _RecordUnpickler(pickle.Unpickler):
    def __init__(self, mapped: mmap.mmap, payload: int, skeleton: bytes):
        super().__init__(io.BytesIO(skeleton))
        self._mapped = mapped
        self._payload = payload  # where the record's buffers start in the mapping

    def persistent_load(self, pid: Any) -> Any:
        kind, offset, nbytes, dtype, shape, requires_grad = pid
        at = self._payload + offset
        if kind == "t":
            import torch

            if nbytes == 0:
                return torch.empty(shape, dtype=dtype, requires_grad=requires_grad)
            tensor = torch.frombuffer(self._mapped, dtype=torch.uint8, count=nbytes, offset=at)
            tensor = tensor.view(dtype).reshape(shape)
            return tensor.requires_grad_() if requires_grad else tensor
        import numpy

        array = numpy.frombuffer(self._mapped, dtype=numpy.uint8, count=nbytes, offset=at)
        return array.view(numpy.dtype(dtype)).reshape(shape)
