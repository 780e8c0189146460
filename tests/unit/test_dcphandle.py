"""A sharded value too big to come back whole, as a handle to its DCP checkpoint (transfer/dcphandle.py): what is
saved for a value, the template the handle keeps, and loading it in a process with no group, fresh or into one's
own tensors. Real checkpoints: a one-process gloo group saves (FSDP2 too), and two real ranks save one model's
shards (forks of this process), which this process, with no group at all, then loads whole."""

from __future__ import annotations

import collections
import datetime
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from taas_magic.transfer import dcphandle
from taas_magic.transfer.dcphandle import CheckpointHandle, TensorShape, state_of, template
from tests.unit.gloo import forked_ranks, one_rank_group

KEYS = ["scale", "embed.weight", "embed.bias", "head.weight", "head.bias"]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 6)
        self.head = torch.nn.Linear(6, 3)
        self.register_buffer("scale", torch.tensor([1.0, 2.0, 3.0]))


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def _saved(value, path: Path, name: str = "value", what: str = "", nbytes: int = 0) -> CheckpointHandle:
    """``value`` saved by every rank (here the one), and rank 0's handle to it, as transfer/sharded.py makes them."""
    state, wrapped = dcphandle.save(value, str(path))
    return CheckpointHandle(name, what or type(value).__name__, nbytes, str(path), template(state), wrapped)


def _load(handle: CheckpointHandle, **into):
    """``handle.load(...)`` with every warning recorded: it says nothing (no group is what it asks for)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = handle.load(**into)
    assert [str(warning.message) for warning in seen] == []
    return loaded


@pytest.fixture(scope="module")
def model_checkpoint(tmp_path_factory):
    """An FSDP2-sharded ``Net`` (one rank) saved with DCP, its handle as it travels (pickled), and the values."""
    folder = tmp_path_factory.mktemp("checkpoints")
    reference = {key: value.clone() for key, value in _net(0).state_dict().items()}
    with one_rank_group() as mesh:
        model = _net(0)
        fully_shard(model, mesh=mesh)
        assert isinstance(model.head.weight, DTensor)
        handle = _saved(model, folder / "whole-model", "model", "Net", 216)
    assert not dist.is_initialized()
    return pickle.loads(pickle.dumps(handle)), reference  # noqa: S301 - our own pickle: as the handle travels


def test_a_module_saves_its_state_dict_a_state_dict_itself_and_anything_else_under_value():
    model = _net(0)
    state, wrapped = state_of(model)
    assert not wrapped and list(state) == KEYS
    assert state["head.weight"].untyped_storage().data_ptr() == model.head.weight.untyped_storage().data_ptr()
    mine = {"w": torch.ones(2), "step": 3}
    assert state_of(mine)[0] is mine and state_of(mine)[1] is False
    empty: dict = {}
    assert state_of(empty)[0] is empty and state_of(empty)[1] is False
    for value in (torch.ones(2), [torch.ones(2)], (torch.ones(2),), {0: torch.ones(2)}, {"w": 1, 2: 3}, 5):
        state, wrapped = state_of(value)
        assert wrapped and list(state) == ["value"] and state["value"] is value


def test_a_template_is_each_tensors_shape_and_dtype_and_everything_else_as_it_is():
    size = torch.Size([2, 3])
    state = {"w": torch.zeros(2, 3), "inner": {"b": torch.zeros(4, dtype=torch.bfloat16)},
             "items": [torch.zeros(1, dtype=torch.int64), 2], "pair": (torch.zeros((), dtype=torch.bool), "x"),
             "step": 7, "size": size}
    shape = template(state)
    assert shape == {"w": TensorShape((2, 3), "float32"), "inner": {"b": TensorShape((4,), "bfloat16")},
                     "items": [TensorShape((1,), "int64"), 2], "pair": (TensorShape((), "bool"), "x"),
                     "step": 7, "size": size}
    assert type(shape["pair"]) is tuple and shape["size"] is size
    assert template(torch.zeros(5, 2, dtype=torch.float16)) == TensorShape((5, 2), "float16")


def test_a_sharded_modules_checkpoint_loads_whole_into_fresh_tensors_with_no_group(model_checkpoint):
    handle, reference = model_checkpoint
    first, second = _load(handle), _load(handle)
    assert list(first) == KEYS and list(second) == KEYS
    for key in KEYS:
        assert type(first[key]) is torch.Tensor and torch.equal(first[key], reference[key])
        assert first[key].untyped_storage().data_ptr() != second[key].untyped_storage().data_ptr()
    first["head.weight"].zero_()
    assert torch.equal(second["head.weight"], reference["head.weight"])  # each load its own tensors


def test_it_loads_into_a_modules_own_tensors_and_into_a_state_dicts(model_checkpoint):
    handle, reference = model_checkpoint
    target = _net(1)
    before = {key: (value.untyped_storage().data_ptr(), value.shape) for key, value in target.state_dict().items()}
    assert not torch.equal(target.head.weight.detach(), reference["head.weight"])
    assert _load(handle, into=target) is target
    after = target.state_dict()
    assert {key: (value.untyped_storage().data_ptr(), value.shape) for key, value in after.items()} == before
    assert all(torch.equal(after[key], reference[key]) for key in KEYS)
    mine = {key: torch.zeros_like(value) for key, value in reference.items()}
    tensors = dict(mine)
    assert _load(handle, into=mine) is mine
    assert list(mine) == KEYS and all(mine[key] is tensors[key] and torch.equal(mine[key], reference[key])
                                      for key in KEYS)


def test_a_value_that_is_not_a_state_dict_comes_back_as_itself(tmp_path):
    values = {"tensor": torch.arange(6.0).view(2, 3),
              "list": [torch.arange(3), torch.ones(2, dtype=torch.bfloat16), 4],
              "pair": (torch.arange(3.0), torch.zeros(2, 2, dtype=torch.int32)),
              "by_layer": {0: torch.arange(2.0), 1: torch.full((3,), 7.0)}}
    with one_rank_group():
        handles = {name: _saved(value, tmp_path / name, name) for name, value in values.items()}
    loaded = {name: _load(handle) for name, handle in handles.items()}
    assert torch.equal(loaded["tensor"], values["tensor"])
    items = loaded["list"]
    assert type(items) is list and len(items) == 3 and items[2] == 4
    assert torch.equal(items[0], values["list"][0]) and torch.equal(items[1], values["list"][1])
    assert items[1].dtype == torch.bfloat16
    pair = loaded["pair"]
    assert type(pair) is tuple and len(pair) == 2 and pair[1].dtype == torch.int32
    assert torch.equal(pair[0], values["pair"][0]) and torch.equal(pair[1], values["pair"][1])
    assert list(loaded["by_layer"]) == [0, 1]
    assert all(torch.equal(loaded["by_layer"][key], values["by_layer"][key]) for key in (0, 1))
    into = torch.zeros(2, 3)
    assert _load(handles["tensor"], into=into) is into and torch.equal(into, values["tensor"])


Stats = collections.namedtuple("Stats", "mean count")


def test_a_named_tuples_tensors_are_shapes_in_the_template_and_it_loads_back_as_itself(tmp_path):
    """The template looks into a named tuple as into a tuple: its tensors are not kept in the handle (they were)."""
    value = {"stats": Stats(torch.arange(4.0), 4)}
    assert template(value) == {"stats": Stats(TensorShape((4,), "float32"), 4)}
    with one_rank_group():
        handle = _saved(value, tmp_path / "stats", "stats", "dict", 16)
    assert "(dict, 1 tensor, 16 B whole)" in repr(handle)
    loaded = _load(handle)["stats"]
    assert type(loaded) is Stats and loaded.count == 4 and torch.equal(loaded.mean, value["stats"].mean)


def test_its_repr_says_what_it_is_and_how_to_load_it(model_checkpoint):
    handle, _ = model_checkpoint
    assert repr(handle) == (f"<taas CheckpointHandle model (Net, 5 tensors, 216 B whole) at {handle.path!r}: .load() "
                            "reads it whole, .load(into=...) into your own module or state dict>")
    other = CheckpointHandle("<final value>", "dict", 2_500_000, "/run/whole-final_value", None, False)
    assert repr(other) == ("<taas CheckpointHandle <final value> (dict, 0 tensors, 2.5 MB whole) at "
                           "'/run/whole-final_value': .load() reads it whole, .load(into=...) into your own module "
                           "or state dict>")
    assert (other.name, other.what, other.nbytes, other.path) == ("<final value>", "dict", 2_500_000,
                                                                  "/run/whole-final_value")


def _saving_rank(rank: int, port: int, folder: str, sends) -> None:
    """One of two ranks (a fork of this process): an FSDP2 model sharded over both, saved as transfer/sharded.py
    saves a name too big to come back; rank 0 pickles its handle, and the whole tensors to check it against."""
    try:
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=20))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        path = os.path.join(folder, "whole-model")
        state, wrapped = dcphandle.save(model, path)
        local = {key: list(value.to_local().shape) for key, value in state.items()}
        full = {key: value.full_tensor() for key, value in state.items()}
        nbytes = sum(value.numel() * value.element_size() for value in full.values())
        handle = CheckpointHandle("model", "Sequential", nbytes, path, template(state) if rank == 0 else None, wrapped)
        if rank == 0:
            torch.save(full, os.path.join(folder, "full.pt"))
            with open(os.path.join(folder, "handle.pickle"), "wb") as file:
                pickle.dump(handle, file)
        dist.barrier()
        report = {"local": local, "files": sorted(os.listdir(path)), "repr": repr(handle)}
        if rank == 0:  # in a rank, alone, while its group lives: no collective waits on the others
            loaded = handle.load()
            report["alone"] = sorted(key for key in full if torch.equal(loaded[key], full[key].detach()))
        dist.barrier()
        dist.destroy_process_group()
        sends.send(report)
    except BaseException as exc:  # noqa: BLE001 - the test says it
        sends.send(f"{type(exc).__name__}: {exc}")


@pytest.fixture(scope="module", autouse=True)
def two_ranks(tmp_path_factory) -> tuple[Path, list]:
    """The folder two real ranks saved into, and what each reports: forks of this process (its imports, and no
    group yet: this runs first), in one gloo group of their own; both joined, or killed."""
    folder = tmp_path_factory.mktemp("run")
    return folder, forked_ranks(_saving_rank, str(folder))


def test_each_rank_writes_its_own_shards_and_rank_0s_handle_says_the_whole(two_ranks):
    folder, reports = two_ranks
    path = str(folder / "whole-model")
    for report in reports:
        assert report["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert report["local"] == {"0.weight": [3, 4], "0.bias": [3], "2.weight": [1, 6], "2.bias": [1]}
    tail = f"whole) at {path!r}: .load() reads it whole, .load(into=...) into your own module or state dict>"
    assert reports[0]["repr"] == f"<taas CheckpointHandle model (Sequential, 4 tensors, 176 B {tail}"
    assert reports[0]["alone"] == ["0.bias", "0.weight", "2.bias", "2.weight"] and "alone" not in reports[1]
    assert reports[1]["repr"] == f"<taas CheckpointHandle model (Sequential, 0 tensors, 176 B {tail}"


def test_a_checkpoint_two_ranks_wrote_loads_whole_here_with_no_group(two_ranks):
    folder, _ = two_ranks
    with open(folder / "handle.pickle", "rb") as file:
        handle = pickle.load(file)  # noqa: S301 - the handle the test's own rank 0 pickled
    full = torch.load(folder / "full.pt")
    assert not dist.is_initialized()
    loaded = _load(handle)
    assert list(loaded) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert {key: tuple(value.shape) for key, value in loaded.items()} == {
        "0.weight": (6, 4), "0.bias": (6,), "2.weight": (2, 6), "2.bias": (2,)}
    assert all(type(loaded[key]) is torch.Tensor and torch.equal(loaded[key], full[key]) for key in full)
    torch.manual_seed(1)
    mine = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    weight = mine[2].weight
    assert _load(handle, into=mine) is mine and mine[2].weight is weight
    assert all(torch.equal(value, full[key]) for key, value in mine.state_dict().items())

