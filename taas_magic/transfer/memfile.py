"""Blob bytes in one owner-only memory file that the receiver maps, or inline when small.

Runs in the kernel and in each rank, at both ends of the closure and of rank 0's results; the
writing, hashing and checking on a few helper threads (``taas-transfer``).

The writer lays the blobs out 64-byte aligned and writes each straight from where it
lives (a tensor's storage, an array's buffer; a CUDA storage is copied to the host
once) into a file created ``0600`` in ``/dev/shm`` (in the temp dir when ``/dev/shm``
lacks the room, or runs out of it while being written). Its bytes are never pickled,
and nothing else holds a copy. The frame that announces the file carries a SHA-256 of
every 8 MB chunk: the frame is authenticated (wire.py), so a reader that finds every
chunk's digest equal knows the bytes are the ones the key holder wrote, and only then
builds tensors on them. The writer hashes each piece as it writes it; writing, hashing
and checking run on a few threads (all release the GIL).

Below ``inline_below`` bytes in all, the blobs travel inside the authenticated frame
instead (no file, no digest needed).

File names carry the kernel's pid (``<prefix><pid>-<run id>-...``): the kernel removes
its own at the end of every cell, and :func:`sweep_all` removes those of a kernel that died.
"""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from taas_magic import tempdirs
from taas_magic.tempdirs import SHM
from taas_magic.transfer.pack import Blob
from taas_magic.wire import AuthenticationError

ALIGN = 64
CHUNK = 8 << 20
INLINE_BYTES = 4 << 20
THREADS = max(1, min(4, os.cpu_count() or 1))
CLOSURE_PREFIX = "taas-closure-"
RESULT_PREFIX = "taas-result-"


@dataclass(frozen=True)
class BlobData:
    """Where blob ``i`` is (``offsets[i]``, ``sizes[i]`` bytes): inline, or in a file with digests."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    size: int
    inline: bytearray | None = None
    path: str | None = None
    digests: tuple[bytes, ...] = ()


def layout(sizes: Sequence[int]) -> tuple[tuple[int, ...], int]:
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end = (end + size + ALIGN - 1) // ALIGN * ALIGN
    return tuple(offsets), end


def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(THREADS, thread_name_prefix="taas-transfer")


def _chunk_digests(view: memoryview, size: int) -> tuple[bytes, ...]:
    spans = [(start, min(start + CHUNK, size)) for start in range(0, size, CHUNK)]
    with _pool() as pool:
        return tuple(pool.map(lambda span: hashlib.sha256(view[span[0]:span[1]]).digest(), spans))


def _chunks(blobs: Sequence[Blob], offsets: Sequence[int], size: int) -> list[list[tuple[memoryview, int]]]:
    """Each 8 MB chunk of the file as the (bytes, file offset) pieces of the blobs that fall in it."""
    chunks: list[list[tuple[memoryview, int]]] = [[] for _ in range(-(-size // CHUNK))]
    for blob, offset in zip(blobs, offsets):
        data = blob.cpu_bytes()  # once per blob: a CUDA storage is copied to the host here
        start = 0
        while start < blob.nbytes:
            at = offset + start
            end = min(blob.nbytes, start + CHUNK - at % CHUNK)
            chunks[at // CHUNK].append((data[start:end], at))
            start = end
    return chunks


def _write_chunk(fd: int, pieces: list[tuple[memoryview, int]], start: int, end: int) -> bytes:
    """Write one chunk's pieces and return the SHA-256 of the chunk as the file holds it
    (the gaps between blobs are the file's zeros), hashing each piece while it is hot."""
    digest = hashlib.sha256()
    position = start
    for view, at in pieces:
        digest.update(bytes(at - position))
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], at + written)
        digest.update(view)
        position = at + len(view)
    digest.update(bytes(end - position))
    return digest.digest()


def _write_file(directory: str, stem: str, chunks: list, offsets: tuple[int, ...], sizes: tuple[int, ...],
                size: int) -> BlobData:
    fd, path = tempfile.mkstemp(prefix=stem, dir=directory)  # 0600
    try:
        os.ftruncate(fd, size)
        with _pool() as pool:
            digests = tuple(pool.map(lambda k: _write_chunk(fd, chunks[k], k * CHUNK, min(size, (k + 1) * CHUNK)),
                                     range(len(chunks))))
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return BlobData(offsets, sizes, size, path=path, digests=digests)


def write(blobs: Sequence[Blob], prefix: str, owner_pid: int, run_id: str, inline_below: int = INLINE_BYTES) -> BlobData:
    """Write the blobs' bytes once, inline or to an owner-only memory file."""
    sizes = tuple(blob.nbytes for blob in blobs)
    offsets, size = layout(sizes)
    if size < inline_below:
        inline = bytearray(size)
        for blob, offset in zip(blobs, offsets):
            inline[offset:offset + blob.nbytes] = blob.cpu_bytes()
        return BlobData(offsets, sizes, size, inline=inline)
    chunks = _chunks(blobs, offsets, size)
    stem = f"{prefix}{owner_pid}-{run_id}-"
    first, fallback = tempdirs.memory_dir(size), tempfile.gettempdir()
    if first != fallback:
        try:
            return _write_file(first, stem, chunks, offsets, sizes, size)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return _write_file(fallback, stem, chunks, offsets, sizes, size)


def open_data(data: BlobData, *, private: bool) -> Any:
    """The blob bytes as a writable buffer, checked against the digests before anything uses them.

    ``private``: a copy-on-write mapping (a rank's closure: writes stay the rank's own);
    otherwise shared (the kernel's results: the file's pages are the only copy).

    Raises:
        AuthenticationError: a chunk of the file does not match its digest.
    """
    if data.path is None:
        return data.inline if data.inline is not None else bytearray()
    fd = os.open(data.path, os.O_RDONLY if private else os.O_RDWR)
    try:
        mapped = mmap.mmap(fd, data.size, access=mmap.ACCESS_COPY if private else mmap.ACCESS_WRITE)
    finally:
        os.close(fd)
    with memoryview(mapped) as view:
        found = _chunk_digests(view, data.size)
    if found != data.digests:
        mapped.close()
        raise AuthenticationError(f"the tensor data file {data.path} does not match the digest the sender vouched for")
    return mapped


def original_view(data: BlobData) -> mmap.mmap | None:
    """A read-only map of the file as the sender wrote it (None if inline or gone)."""
    if data.path is None:
        return None
    try:
        fd = os.open(data.path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return mmap.mmap(fd, data.size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def remove(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def remove_run(owner_pid: int, run_id: str) -> None:
    """Remove every result file a run's rank 0 wrote, wherever it went."""
    stem = f"{RESULT_PREFIX}{owner_pid}-{run_id}-"
    for directory in {SHM, tempfile.gettempdir()}:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if name.startswith(stem):
                remove(os.path.join(directory, name))


def sweep_all() -> None:
    """Remove the files killed kernels left (``<prefix><pid>-...`` whose pid is gone)."""
    for directory in {SHM, tempfile.gettempdir()}:
        if os.path.isdir(directory):
            for prefix in (CLOSURE_PREFIX, RESULT_PREFIX):
                tempdirs.sweep_orphans(directory, prefix)
