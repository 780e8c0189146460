"""The data workers' element records (transfer/records.py), through real segment files: what a record is,
its tensors' and arrays' bytes out of the pickle and 64-byte aligned, read back on a copy-on-write mapping of
the record (no copy; a change in place never reaches the file), and moved between hosts verbatim."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from taas_magic.transfer import records
from taas_magic.transfer.records import ALIGN, HEADER, SegmentReader, aligned, encode, read_raw, write


def _element() -> dict:
    return {
        "x": torch.arange(12, dtype=torch.float32).view(3, 4),
        "scalar": torch.tensor(5),
        "mask": torch.tensor([True, False, True]),
        "half": torch.full((3,), 1.5, dtype=torch.bfloat16),
        "grad": torch.ones(2, requires_grad=True),
        "transposed": torch.arange(6).view(2, 3).t(),
        "empty": torch.empty(0, 3),
        "empty_grad": torch.zeros(0, requires_grad=True),
        "strided": torch.arange(8.0)[::2],
        "array": np.arange(6, dtype=np.int16).reshape(2, 3),
        "big_endian": np.arange(3, dtype=">i4"),
        "label": "cat",
        "index": 3,
    }


def _segment(tmp_path, *elements, name="segment", at=0):
    """A pre-sized segment file, as a worker makes one, with ``elements`` appended from ``at``; their offsets."""
    path = str(tmp_path / name)
    encoded = [encode(element) for element in elements]
    offsets, end = [], at
    for _, _, length in encoded:
        offsets.append(end)
        end = aligned(end + length)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.ftruncate(fd, end)
        for offset, (head, buffers, _) in zip(offsets, encoded):
            write(fd, offset, head, buffers)
    finally:
        os.close(fd)
    return path, offsets


def _assert_same(got: dict, expected: dict) -> None:
    assert list(got) == list(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert type(got[key]) is torch.Tensor and got[key].dtype == value.dtype and got[key].shape == value.shape
            assert torch.equal(got[key], value.detach()) and got[key].requires_grad == value.requires_grad
        elif isinstance(value, np.ndarray):
            assert type(got[key]) is np.ndarray and got[key].dtype == value.dtype
            np.testing.assert_array_equal(got[key], value)
        else:
            assert got[key] == value


def test_aligned_rounds_up_to_64_bytes():
    assert ALIGN == 64
    assert [aligned(offset) for offset in (0, 1, 63, 64, 65, 130)] == [0, 64, 64, 64, 128, 192]


def test_a_record_is_a_header_a_skeleton_and_its_buffers_aligned_after_it():
    element = _element()
    element["x"] = torch.arange(1 << 18, dtype=torch.float32)  # 1 MB: never in the pickle
    head, buffers, length = encode(element)
    magic, skeleton, total = HEADER.unpack(head[:HEADER.size])
    assert (magic, skeleton, total) == (b"TAAS", len(head) - HEADER.size, length) and len(head) < 4096
    offsets = [offset for offset, _ in buffers]
    assert offsets[0] == aligned(len(head)) and all(offset % 64 == 0 for offset in offsets)
    sizes = [raw.numel() if isinstance(raw, torch.Tensor) else raw.size for _, raw in buffers]
    # x, scalar, mask, half, grad, transposed, empty, empty_grad, strided; then the two arrays
    assert sizes == [1 << 20, 8, 3, 6, 8, 48, 0, 0, 16, 12, 12]
    assert offsets == [aligned(len(head))] + [aligned(offset + size) for offset, size in zip(offsets, sizes)][:-1]
    assert length == offsets[-1] + aligned(12)


def test_an_element_comes_back_equal_from_a_segment(tmp_path):
    first, second = _element(), {"only": torch.arange(3.0), "words": ["a", "b"]}
    path, offsets = _segment(tmp_path, first, second)
    assert offsets[1] % 64 == 0 and offsets[1] % os.sysconf("SC_PAGE_SIZE") != 0  # mapped from the page before it
    reader = SegmentReader()
    try:
        _assert_same(reader.read(path, offsets[0]), first)
        _assert_same(reader.read(path, offsets[1]), second)
    finally:
        reader.close()


def test_what_is_not_a_plain_tensor_or_array_is_pickled_with_only_its_plain_tensors_out_of_band(tmp_path):
    assert encode({"conj": torch.tensor([1 + 2j]).conj(), "objects": np.array([{"a": 1}], dtype=object)})[1] == []
    # a Parameter and a sparse tensor reduce to plain tensors: those are placed, not pickled
    assert [raw.numel() for _, raw in encode(torch.nn.Parameter(torch.ones(2)))[1]] == [8]
    assert [raw.numel() for _, raw in encode(torch.eye(2).to_sparse())[1]] == [32, 8]
    element = {"param": torch.nn.Parameter(torch.ones(2)), "conj": torch.tensor([1 + 2j]).conj(),
               "objects": np.array([{"a": 1}], dtype=object), "sparse": torch.eye(2).to_sparse()}
    path, offsets = _segment(tmp_path, element)
    reader = SegmentReader()
    try:
        got = reader.read(path, offsets[0])
    finally:
        reader.close()
    assert type(got["param"]) is torch.nn.Parameter and torch.equal(got["param"].detach(), torch.ones(2))
    assert got["param"].requires_grad
    assert got["conj"].is_conj() and torch.equal(got["conj"].resolve_conj(), torch.tensor([1 - 2j]))
    assert got["objects"].dtype == object and got["objects"][0] == {"a": 1}
    assert got["sparse"].layout == torch.sparse_coo and torch.equal(got["sparse"].to_dense(), torch.eye(2))


def test_tensors_are_built_on_one_private_mapping_of_the_record(tmp_path):
    element = {"a": torch.arange(4.0), "b": torch.arange(8, dtype=torch.int64)}
    _, buffers, _ = encode(element)
    path, offsets = _segment(tmp_path, element)
    with open(path, "rb") as file:
        stored = file.read()
    reader = SegmentReader()
    try:
        got = reader.read(path, offsets[0])
        # both on one mapping, as far apart as in the record: no copy of either
        assert got["b"].data_ptr() - got["a"].data_ptr() == buffers[1][0] - buffers[0][0]
        got["a"].add_(100)  # the cell's change is its own pages'
        with open(path, "rb") as file:
            assert file.read() == stored
        assert torch.equal(reader.read(path, offsets[0])["a"], torch.arange(4.0))  # a later pass sees the prepared bytes
    finally:
        reader.close()


def test_a_reader_opens_each_segment_once_and_closes_them(tmp_path):
    path, offsets = _segment(tmp_path, {"t": torch.ones(1)}, {"t": torch.zeros(1)})
    other, _ = _segment(tmp_path, {"t": torch.ones(1)}, name="other")
    before = set(os.listdir("/proc/self/fd"))
    reader = SegmentReader()
    for offset in offsets:
        reader.read(path, offset)
    reader.read(other, 0)
    assert len(set(os.listdir("/proc/self/fd")) - before) == 2
    reader.close()
    assert set(os.listdir("/proc/self/fd")) == before
    assert torch.equal(reader.read(path, offsets[1])["t"], torch.zeros(1))  # and opens again when asked
    reader.close()


def test_a_record_moves_verbatim_to_another_segment_at_another_aligned_offset(tmp_path):
    element = _element()
    path, offsets = _segment(tmp_path, {"before": torch.ones(5)}, element, {"after": torch.ones(5)})
    raw = read_raw(path, offsets[1])
    with open(path, "rb") as file:
        file.seek(offsets[1])
        assert raw == file.read(len(raw))
    assert len(raw) == HEADER.unpack(raw[:HEADER.size])[2] and raw.startswith(b"TAAS")
    mirror = str(tmp_path / "mirror")
    with open(mirror, "wb") as file:
        file.write(b"\0" * 4160 + raw)  # a host's own segment: another 64-byte aligned place
    reader = SegmentReader()
    try:
        _assert_same(reader.read(mirror, 4160), element)
    finally:
        reader.close()


def test_an_offset_with_no_record_is_said_to_be_one(tmp_path):
    path, _ = _segment(tmp_path, {"t": torch.ones(1)})
    with open(path, "r+b") as file:
        file.write(b"NOPE")
    message = f"taas: no element record at {path}:0"
    with pytest.raises(ValueError) as raised:
        read_raw(path, 0)
    assert str(raised.value) == message
    reader = SegmentReader()
    try:
        with pytest.raises(ValueError) as raised:
            reader.read(path, 0)
        assert str(raised.value) == message
    finally:
        reader.close()
    assert records.MAGIC == b"TAAS"


def test_a_structured_array_comes_back_with_its_fields(tmp_path):
    """Its dtype travels whole: by its ``str`` alone (``|V12``) the fields were lost and the rows came back as bytes."""
    rows = np.array([(1, 2.5), (3, -1.0)], dtype=[("id", "<i4"), ("score", "<f8")])
    path, offsets = _segment(tmp_path, {"rows": rows})
    got = SegmentReader().read(path, offsets[0])["rows"]
    assert got.dtype == rows.dtype and got.dtype.names == ("id", "score")
    assert got["id"].tolist() == [1, 3] and got["score"].tolist() == [2.5, -1.0]
