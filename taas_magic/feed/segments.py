"""Where the prepared elements live: segment files in RAM (/dev/shm) up to a budget, then on disk.

Runs in the kernel (:class:`CacheDirs`, made in a run's plan step), in each data worker
(:class:`SegmentWriter`, on its main thread) and in a Ray host agent or Slurm task (a host's cache
folders, and the records mirrored there).

The kernel makes two private directories per run (:class:`CacheDirs`): one in
``/dev/shm`` (memory) and one in ``$TAAS_SPILL_DIR`` or the temporary directory
(disk). Each worker appends records to segment files of its own
(:class:`SegmentWriter`): in memory while its share of ``--cache-ram`` lasts, on disk
after that, so K in the tens of millions never exhausts memory. Segment files are
created sparse at full size, so a rank maps each one once. The directories carry the
kernel's pid, so a later run removes those of a kernel that was killed.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from taas_magic.tempdirs import ram_root, remove_tree, spill_root, sweep_orphans
from taas_magic.transfer import records

SEGMENT_BYTES = 64 << 20
PREFIX = "taas-data-"


def _disk_usage(path: str) -> int:
    """Bytes a directory's files really occupy (sparse segments count what was written)."""
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


@dataclass
class CacheDirs:
    ram: str
    disk: str

    @classmethod
    def create(cls, run_id: str) -> "CacheDirs":
        for root in {ram_root(), spill_root()}:
            sweep_orphans(root, PREFIX)
        name = f"{PREFIX}{os.getpid()}-{run_id}-"
        return cls(tempfile.mkdtemp(prefix=name, dir=ram_root()), tempfile.mkdtemp(prefix=name, dir=spill_root()))

    def usage(self) -> tuple[int, int]:
        """(bytes in RAM, bytes on disk) the cache occupies now."""
        return _disk_usage(self.ram), _disk_usage(self.disk)

    def remove(self) -> None:
        remove_tree(self.ram)
        remove_tree(self.disk)


class SegmentWriter:
    """A worker's append-only segments: RAM first, disk once its RAM budget is spent."""

    def __init__(self, dirs: CacheDirs, worker: int, ram_budget: int, segment_bytes: int = SEGMENT_BYTES):
        self.dirs = dirs
        self.worker = worker
        self.ram_budget = ram_budget
        self.segment_bytes = segment_bytes
        self.ram_used = 0  # bytes of segments placed in RAM (whole segments: they are reserved)
        self._count = 0
        self._fd = -1
        self._path = ""
        self._size = 0
        self._end = 0

    def _open_segment(self, at_least: int) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        size = max(self.segment_bytes, at_least)
        in_ram = self.ram_used + size <= self.ram_budget
        directory = self.dirs.ram if in_ram else self.dirs.disk
        self._path = os.path.join(directory, f"w{self.worker}-{self._count}.seg")
        self._count += 1
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(self._fd, size)  # sparse: pages exist only where records are written
        self._size, self._end = size, 0
        if in_ram:
            self.ram_used += size

    def append(self, element: object) -> tuple[str, int]:
        """Store one element; return (segment path, offset) for the ranks to read it."""
        head, buffers, length = records.encode(element)
        at = self._place(length)
        records.write(self._fd, at, head, buffers)
        return self._path, at

    def append_raw(self, record: bytes) -> tuple[str, int]:
        """Store a record made elsewhere (another host's worker), byte for byte."""
        at = self._place(len(record))
        os.pwrite(self._fd, record, at)
        return self._path, at

    def _place(self, length: int) -> int:
        if self._fd < 0 or self._end + length > self._size:
            self._open_segment(length)
        at = self._end
        self._end = records.aligned(at + length)
        return at

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
