"""The cache's folders and a worker's segment files (feed/segments.py), on real folders and files: the run's
two private folders (memory and ``$TAAS_SPILL_DIR``) named for the kernel, a dead kernel's swept as a run
starts and a live one's kept; segments made sparse at full size, owner-only, RAM first then disk once the
worker's share is spent, records 64-byte aligned and read back as a rank reads them (transfer/records.py),
a record from another host stored byte for byte; and the footprint measured on what was really written."""

import os
import stat
import subprocess
import sys

import pytest
import torch

from taas_magic.feed.segments import PREFIX, CacheDirs, SegmentWriter
from taas_magic.tempdirs import ram_root
from taas_magic.transfer import records
from taas_magic.transfer.records import ALIGN, SegmentReader, read_raw

SEGMENT = 64 << 10


@pytest.fixture
def spill(tmp_path, monkeypatch):
    """The disk folder of the cache goes under the test's own folder."""
    folder = tmp_path / "spill"
    folder.mkdir()
    monkeypatch.setenv("TAAS_SPILL_DIR", str(folder))
    return folder


@pytest.fixture
def dirs(tmp_path):
    """Two plain folders standing for the run's RAM and disk folders (CacheDirs is a pair of paths)."""
    (tmp_path / "ram").mkdir()
    (tmp_path / "disk").mkdir()
    return CacheDirs(str(tmp_path / "ram"), str(tmp_path / "disk"))


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_run_gets_two_owner_only_folders_named_for_the_kernel_and_the_run(spill):
    dirs = CacheDirs.create("run7")
    try:
        assert os.path.dirname(dirs.ram) == ram_root() and os.path.dirname(dirs.disk) == str(spill)
        for path in (dirs.ram, dirs.disk):
            assert os.path.basename(path).startswith(f"{PREFIX}{os.getpid()}-run7-")
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        assert dirs.ram != dirs.disk
        assert dirs.usage() == (0, 0)
    finally:
        dirs.remove()
    assert not os.path.exists(dirs.ram) and not os.path.exists(dirs.disk)


def test_a_new_run_removes_the_folders_a_dead_kernel_left_and_keeps_a_live_ones(spill):
    gone = _dead_pid()
    dead = spill / f"{PREFIX}{gone}-old-abc"
    (dead / "sub").mkdir(parents=True)
    (dead / "sub" / "w0-0.seg").write_bytes(b"x")
    live = spill / f"{PREFIX}{os.getpid()}-other-abc"  # this kernel's other run
    live.mkdir()
    unrelated = spill / f"taas-scratch-{gone}-x"  # another feature's prefix: not the cache's to sweep
    unrelated.mkdir()
    dirs = CacheDirs.create("new")
    try:
        assert not dead.exists()
        assert live.exists() and unrelated.exists()
    finally:
        dirs.remove()


def test_segments_are_sparse_owner_only_and_fill_ram_first_then_disk(dirs):
    writer = SegmentWriter(dirs, worker=3, ram_budget=2 * SEGMENT, segment_bytes=SEGMENT)
    element = torch.arange(2048, dtype=torch.int64)  # 16 KiB of payload: four a segment at most
    places = [writer.append(element + k) for k in range(12)]
    writer.close()
    paths = sorted({path for path, _ in places}, key=lambda p: int(p.rsplit("-", 1)[1].split(".")[0]))
    names = [os.path.relpath(path, os.path.dirname(dirs.ram)) for path in paths]
    assert names[:2] == ["ram/w3-0.seg", "ram/w3-1.seg"]  # its RAM share: two whole segments
    assert all(name.startswith("disk/w3-") for name in names[2:]) and len(names) >= 3
    assert writer.ram_used == 2 * SEGMENT
    for path in paths:
        info = os.stat(path)
        assert info.st_size == SEGMENT and stat.S_IMODE(info.st_mode) == 0o600  # full size at once, owner-only
    assert all(offset % ALIGN == 0 for _, offset in places)
    reader = SegmentReader()
    try:
        for k, (path, offset) in enumerate(places):
            assert torch.equal(reader.read(path, offset), element + k)
    finally:
        reader.close()


def test_a_segment_occupies_only_what_was_written_to_it(dirs):
    writer = SegmentWriter(dirs, worker=0, ram_budget=1 << 30, segment_bytes=16 << 20)
    writer.append(b"small")
    writer.close()
    ram, disk = dirs.usage()
    assert 0 < ram < 1 << 20 and disk == 0  # 16 MiB made, a page or so used


def test_with_no_ram_share_every_segment_is_on_disk(dirs):
    writer = SegmentWriter(dirs, worker=1, ram_budget=0, segment_bytes=SEGMENT)
    path, _ = writer.append({"label": "cat"})
    writer.close()
    assert os.path.dirname(path) == dirs.disk and writer.ram_used == 0
    assert os.listdir(dirs.ram) == []


def test_an_element_larger_than_a_segment_gets_a_segment_of_its_own_size(dirs):
    writer = SegmentWriter(dirs, worker=0, ram_budget=1 << 30, segment_bytes=SEGMENT)
    small_path, _ = writer.append(1)
    big = torch.ones(4 * SEGMENT, dtype=torch.uint8)
    big_path, big_offset = writer.append(big)
    after_path, _ = writer.append(2)
    writer.close()
    assert big_path != small_path and big_offset == 0
    assert os.stat(big_path).st_size >= 4 * SEGMENT
    assert after_path != big_path  # the big one's segment is full: the next record starts another
    reader = SegmentReader()
    try:
        assert torch.equal(reader.read(big_path, big_offset), big)
    finally:
        reader.close()


def test_a_record_made_elsewhere_is_stored_byte_for_byte_and_reads_back(dirs, tmp_path):
    (tmp_path / "other").mkdir()
    elsewhere = SegmentWriter(CacheDirs(str(tmp_path / "other"), str(tmp_path / "other")), 0, 1 << 30, SEGMENT)
    element = {"x": torch.randn(3, 5), "y": 4}
    record = read_raw(*elsewhere.append(element))
    elsewhere.close()
    writer = SegmentWriter(dirs, worker=0, ram_budget=1 << 30, segment_bytes=SEGMENT)
    writer.append("first")
    path, offset = writer.append_raw(record)
    writer.close()
    assert offset % ALIGN == 0 and offset > 0
    assert read_raw(path, offset) == record
    reader = SegmentReader()
    try:
        got = reader.read(path, offset)
    finally:
        reader.close()
    assert torch.equal(got["x"], element["x"]) and got["y"] == 4


def test_records_follow_one_another_aligned_in_a_segment(dirs):
    writer = SegmentWriter(dirs, worker=0, ram_budget=1 << 30, segment_bytes=SEGMENT)
    places = [writer.append("x" * size) for size in (1, 100, 1000)]
    writer.close()
    writer.close()  # closing twice is harmless
    assert len({path for path, _ in places}) == 1
    offsets = [offset for _, offset in places]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for (path, offset), following in zip(places, offsets[1:]):
        length = records.HEADER.unpack(read_raw(path, offset)[: records.HEADER.size])[2]
        assert following == records.aligned(offset + length)
