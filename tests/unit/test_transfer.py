"""The transfer contract: per-name segments of one pickle, tensor bytes out of band, failures kept to their names."""

import os
import threading

import numpy as np
import pytest
import torch

from taas_magic import wire
from taas_magic.transfer import memfile, unpack
from taas_magic.transfer.pack import pack


def _send(items, threshold=memfile.INLINE_BYTES, **options):
    packing = pack(items, **options)
    data = memfile.write(packing.blobs, "taas-test-", os.getpid(), "unit", threshold)
    return packing, data


def _receive(packing, data, private=True):
    buffer = memfile.open_data(data, private=private)
    places = [("at", offset, size) for offset, size in zip(data.offsets, data.sizes)]
    return unpack.load(packing.skeleton, packing.segments, unpack.resolver(unpack.Blobs(places, buffer)))


def test_references_between_names_survive_and_tensor_bytes_are_not_in_the_pickle():
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    packing, data = _send([("model", model), ("opt", opt), ("alias", model), ("head", model.weight[:2])])
    assert len(packing.skeleton) < 8192 and data.size >= 256 * 256 * 4  # the bytes travel beside the pickle
    values, failed = _receive(packing, data)
    assert not failed
    assert values["alias"] is values["model"]
    assert values["opt"].param_groups[0]["params"][0] is values["model"].weight
    assert values["opt"].state[values["model"].weight]["momentum_buffer"].shape == (256, 256)
    assert values["head"].untyped_storage().data_ptr() == values["model"].weight.untyped_storage().data_ptr()
    assert torch.equal(values["model"].weight, model.weight)


def test_numpy_arrays_travel_out_of_band_and_keep_their_layout():
    arrays = {"c": np.arange(12, dtype=np.int16).reshape(3, 4), "f": np.asfortranarray(np.ones((2, 3))),
              "o": np.array([{"a": 1}], dtype=object)}
    packing, data = _send([("arrays", arrays), ("same", arrays["c"])])
    assert len(packing.blobs) == 1  # the Fortran and object arrays are pickled in-band, as numpy does
    values, failed = _receive(packing, data)
    assert not failed and values["same"] is values["arrays"]["c"]
    assert values["arrays"]["c"].dtype == np.int16 and values["arrays"]["c"][2, 3] == 11
    assert values["arrays"]["f"].flags.f_contiguous and values["arrays"]["o"][0] == {"a": 1}


def test_a_name_that_cannot_be_pickled_costs_only_itself():
    packing, data = _send([("a", [1]), ("lock", threading.Lock()), ("b", {"k": torch.ones(3)})])
    assert packing.failed == [("lock", "_thread.lock", "TypeError: cannot pickle '_thread.lock' object")]
    values, failed = _receive(packing, data)
    assert not failed and values["a"] == [1] and values["b"]["k"].tolist() == [1.0, 1.0, 1.0]


class LoadsOnlyWithAKey:
    allowed = True

    def __init__(self):
        self.payload = torch.arange(4)

    def __setstate__(self, state):
        if not LoadsOnlyWithAKey.allowed:
            raise RuntimeError("not here")
        self.__dict__.update(state)


def test_a_name_that_cannot_be_loaded_costs_itself_and_what_shares_its_objects():
    first = {"n": 1}
    bad = LoadsOnlyWithAKey()
    packing, data = _send([("first", first), ("bad", bad), ("holder", [bad]), ("after", [first, {"m": 2}]), ("last", 5)])
    LoadsOnlyWithAKey.allowed = False
    try:
        values, failed = _receive(packing, data)
    finally:
        LoadsOnlyWithAKey.allowed = True
    assert [name for name, _, _ in failed] == ["bad", "holder"]
    assert failed[0][2] == "RuntimeError: not here"
    assert failed[1][2] == "shares an object with bad, which could not be loaded"
    # later segments still find the right objects in the memo
    assert values["after"][0] is values["first"] and values["after"][1] == {"m": 2} and values["last"] == 5


def test_the_memory_file_is_owner_only_checked_and_large_data_is_never_inline():
    packing, data = _send([("big", torch.ones(1 << 20))], threshold=1024)
    try:
        assert data.inline is None and oct(os.stat(data.path).st_mode & 0o777) == "0o600"
        assert len(data.digests) == -(-data.size // memfile.CHUNK)
        values, _ = _receive(packing, data, private=False)
        values["big"].mul_(2)  # a shared map: the kernel's results are writable, and the file's pages are the copy
        with open(data.path, "r+b") as handle:
            assert handle.read(4) == np.float32(2).tobytes()
            handle.seek(100)
            handle.write(b"\x01")
        with pytest.raises(wire.AuthenticationError, match="does not match the digest"):
            memfile.open_data(data, private=True)
    finally:
        memfile.remove(data.path)


def test_wrappers_travel_as_their_module_only_when_asked():
    inner = torch.nn.Linear(2, 2)
    wrapped = torch.nn.DataParallel(inner)
    packing, data = _send([("wrapped", wrapped), ("inner", inner)], unwrap=True)
    assert packing.segments[0].note == "came back as its module"
    values, _ = _receive(packing, data)
    assert values["wrapped"] is values["inner"] and type(values["inner"]) is torch.nn.Linear
    plain, plain_data = _send([("wrapped", wrapped)])
    assert type(_receive(plain, plain_data)[0]["wrapped"]) is torch.nn.DataParallel


def test_a_segment_lists_the_earlier_segments_whose_objects_it_reaches():
    shared = torch.nn.Linear(2, 2)
    packing = pack([("a", shared), ("b", torch.ones(2)), ("c", [shared.weight]), ("d", torch.zeros(2))], track=True)
    deps = {segment.name: set(segment.deps) for segment in packing.segments}
    # dtypes, functions and classes are shared too, but their identity never matters
    assert deps == {"a": set(), "b": set(), "c": {0}, "d": set()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_storages_are_copied_to_the_host_once():
    packing, data = _send([("t", torch.arange(8, device="cuda"))])
    values, _ = _receive(packing, data)
    assert values["t"].device.type == "cuda" and values["t"].tolist() == list(range(8))


def test_the_page_map_tells_pages_read_from_pages_written(tmp_path):
    import ctypes
    import mmap

    from taas_magic.transfer.returns import _pages_untouched

    path = tmp_path / "shipped"
    path.write_bytes(b"x" * (64 * mmap.PAGESIZE))
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
    size = 64 * mmap.PAGESIZE
    assert _pages_untouched(base, size)  # nothing touched yet
    assert sum(mapped[i * mmap.PAGESIZE] for i in range(64)) == 64 * ord("x")
    assert _pages_untouched(base, size)  # read: still the file's pages
    mapped[5 * mmap.PAGESIZE] = ord("y")
    assert not _pages_untouched(base, size) and not _pages_untouched(base + 5 * mmap.PAGESIZE + 7, 1)
    assert _pages_untouched(base + 6 * mmap.PAGESIZE, 10 * mmap.PAGESIZE)


def test_a_full_dev_shm_falls_back_to_the_temp_dir(monkeypatch, tmp_path):
    import errno

    real = memfile._write_file
    tried = []

    def full_shm(directory, *args):
        tried.append(directory)
        if directory == memfile.SHM:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(directory, *args)

    monkeypatch.setattr(memfile, "_write_file", full_shm)
    monkeypatch.setattr(memfile.tempfile, "tempdir", str(tmp_path))
    packing, data = _send([("t", torch.arange(1 << 16))], threshold=1024)
    try:
        assert tried == [memfile.SHM, str(tmp_path)] and data.path.startswith(str(tmp_path))
        assert _receive(packing, data)[0]["t"][-1] == (1 << 16) - 1
    finally:
        memfile.remove(data.path)


class WarnsWhenLoaded:
    """A library object whose ``__setstate__`` uses a deprecated helper (Lightning's with torch's LeafSpec)."""

    def __init__(self):
        self.payload = torch.arange(3)

    def __setstate__(self, state):
        import warnings

        warnings.warn("`LeafSpec` is deprecated", FutureWarning, stacklevel=2)
        warnings.warn("an old helper", DeprecationWarning, stacklevel=2)
        self.__dict__.update(state)


def test_no_deprecation_raised_while_rebuilding_a_value_reaches_the_cell():
    import warnings

    packing, data = _send([("obj", WarnsWhenLoaded()), ("after", [1])])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values, failed = _receive(packing, data)
        warnings.warn("the cell's own warning still shows", UserWarning, stacklevel=1)
    assert not failed and values["obj"].payload.tolist() == [0, 1, 2] and values["after"] == [1]
    assert [str(w.message) for w in caught] == ["the cell's own warning still shows"]
