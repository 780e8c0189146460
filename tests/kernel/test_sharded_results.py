"""A sharded model comes back to the notebook whole: FSDP2 and DTensor names through a real kernel.

Each cell runs 2 CPU ranks with gloo, shards a small model with ``fully_shard`` on a CPU mesh,
trains it a little and binds, on every rank, the whole parameters as the ranks see them
(``full_tensor()``): the notebook's model must equal them. The memory bound is measured twice:
the kernel's resident memory through a real kernel, and rank 0's peak over the gather itself
(``VmHWM``) in two gloo processes running the ranks' own code (transfer/sharded.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.unit.gloo import free_port, fresh_ranks

ROOT = Path(__file__).resolve().parents[2]

HEAD = """#pragma taas --gpus 2 --device cpu
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def train(model, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 5)).pow(2).mean().backward()
        opt.step()


mesh = init_device_mesh("cpu", (2,))
torch.manual_seed(0)
model = Net()
fully_shard(model.a, mesh=mesh)
fully_shard(model, mesh=mesh)
train(model, 2)
expected = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
"""

WHOLE_MODEL = """
from torch.distributed.fsdp import FSDPModule
assert type(model) is Net, type(model)
params = dict(model.named_parameters())
assert list(params) == list(expected) == ["a.weight", "a.bias", "b.weight", "b.bias"], list(params)
for name, p in params.items():
    assert type(p) is torch.nn.Parameter and p.device.type == "cpu" and torch.equal(p, expected[name]), name
assert not any(isinstance(m, FSDPModule) for m in model.modules())
hooks = ("_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
         "_load_state_dict_post_hooks")
assert not any(getattr(m, table) for m in model.modules() for table in hooks)
assert not any(key.startswith("__composable") for m in model.modules() for key in vars(m))
assert model(torch.ones(2, 5)).shape == (2, 3)
"""


def _ran(kernel, cell: str):
    ran = kernel.execute(cell, timeout=300)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    return ran


def _check(kernel, code: str) -> None:
    checked = kernel.execute(code)
    assert checked.reply["status"] == "ok", checked.error_text()


def test_an_fsdp_model_and_a_state_dict_of_dtensors_come_back_whole(kernel):
    ran = _ran(kernel, HEAD + """
del mesh
state = {"model": model.state_dict(), "step": 2}
with torch.no_grad():
    doubled = {name: t * 2 for name, t in model.state_dict().items()}  # new DTensors: gathered on their own
""")
    stderr = ran.stream("stderr")
    assert "could not come back" not in stderr, stderr
    notes = next(line for line in ran.stream("stdout").splitlines() if line.startswith("taas: model:")).split("; ")
    assert sorted(notes) == ["doubled: dict, came back whole (4 DTensors gathered from 2 ranks, 264 B)",
                             "state: dict, came back whole (gathered with model)",
                             "taas: model: FSDPNet, came back whole as Net (4 DTensors gathered from 2 ranks, 264 B)"], notes
    _check(kernel, WHOLE_MODEL + """
whole = state["model"]
assert state["step"] == 2 and sorted(whole) == sorted(expected), sorted(whole)
assert all(type(t) is torch.Tensor and t.device.type == "cpu" and torch.equal(t, expected[k]) for k, t in whole.items())
Net().load_state_dict(whole)
# a state dict shares its model's storage, as in any notebook; what the cell computed is its own
assert whole["a.weight"].untyped_storage().data_ptr() == model.a.weight.untyped_storage().data_ptr()
assert all(torch.equal(doubled[k], 2 * expected[k]) for k in expected)
del model, state, expected, whole, doubled
""")


def test_kept_ranks_keep_their_sharded_model_and_state_dict_while_a_whole_copy_comes_back(kernel):
    """With --keep, rank 0's names are gathered whole for the notebook on new objects: its own FSDP model, its
    optimizer's state and a dict of DTensors stay sharded in the rank, and the next kept cell trains on them."""
    keep = HEAD.replace("--device cpu", "--device cpu --keep")
    try:
        ran = _ran(kernel, keep + "state = {'model': model.state_dict()}\nsharded = type(model.a.weight).__name__\n")
        assert "taas: model: FSDPNet, came back whole as Net" in ran.stream("stdout"), ran.stream()
        _check(kernel, WHOLE_MODEL + "assert all(type(t) is torch.Tensor for t in state['model'].values())\n"
                                      "assert sharded == 'DTensor'")
        again = _ran(kernel, "#pragma taas --gpus 2 --device cpu --keep\n"
                             "from torch.distributed.fsdp import FSDPModule\n"
                             "assert isinstance(model, FSDPModule) and type(model.a.weight).__name__ == 'DTensor'\n"
                             "assert all(type(t).__name__ == 'DTensor' for t in state['model'].values())\n"
                             "train(model, 2)\n"
                             "after = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}\n")
        assert "taas: --keep: cell 2 on the kept ranks" in again.stream(), again.stream()
        _check(kernel, "assert any(not torch.equal(after[k], expected[k]) for k in expected)  # it trained on\n"
                       "del model, state, expected, after, sharded")
    finally:
        released = kernel.execute("%taas release")
        assert released.reply["status"] == "ok", released.error_text()


def test_a_cell_that_destroys_its_group_still_brings_the_model_back(kernel):
    ran = _ran(kernel, HEAD + "del mesh\ndist.destroy_process_group()\nmodel\n")
    assert "taas: model: FSDPNet, came back whole as Net" in ran.stream("stdout"), ran.stream()
    _check(kernel, WHOLE_MODEL + f"""
assert Out[{ran.reply['execution_count']}] is model
del model, expected
""")


def test_names_the_ranks_disagree_on_are_listed_and_nothing_hangs(kernel):
    ran = _ran(kernel, HEAD + """
from torch.distributed.tensor import DTensor, Shard
rows = 2 + dist.get_rank()  # each rank's shard has its own number of rows: the whole shapes differ
odd = DTensor.from_local(torch.ones(rows, 4), mesh, [Shard(0)], run_check=False)
if dist.get_rank() == 1:
    only_in_rank_1 = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], run_check=False)
del mesh
dist.destroy_process_group()
""")
    stderr = ran.stream("stderr")
    assert "could not come back" in stderr, stderr
    reported = stderr.split("could not come back", 1)[1].splitlines()[0]
    assert " odd (" in reported and "the ranks hold different DTensors under this name: not gathered" in reported, reported
    assert "only_in_rank_1" not in stderr and " model (" not in reported, stderr
    _check(kernel, WHOLE_MODEL + """
assert "odd" not in dir() and "only_in_rank_1" not in dir()
del model, expected
""")


def test_a_model_too_big_for_the_host_comes_back_as_a_handle_to_its_checkpoint(kernel, tmp_path):
    _check(kernel, f"import os\nos.environ['TAAS_GATHER_MAX_BYTES'] = '100'\n%config TaasMagics.checkpoint_dir = {str(tmp_path)!r}")
    try:
        ran = _ran(kernel, HEAD + "del mesh\ndist.destroy_process_group()\n")
    finally:
        _check(kernel, "del os.environ['TAAS_GATHER_MAX_BYTES']\n%config TaasMagics.checkpoint_dir = ''")
    line = next(line for line in ran.stream("stdout").splitlines() if line.startswith("taas: model:"))
    assert line.startswith("taas: model: FSDPNet, FSDP-sharded, 264 B whole, more than the 100 B a gather may bring to "
                           "this host (TAAS_GATHER_MAX_BYTES=100); bound as a handle to its DCP checkpoint at "
                           f"{tmp_path}/"), line
    assert line.endswith("/whole-model: model.load() reads it whole"), line
    folder = line.split(" at ", 1)[1].split(": ", 1)[0]
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # each rank wrote its shards
    _check(kernel, f"""
assert type(model).__name__ == "CheckpointHandle" and {folder!r} in repr(model), repr(model)
loaded = model.load()
assert sorted(loaded) == sorted(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected)
net = Net()
assert model.load(into=net) is net
assert all(torch.equal(p, expected[name]) for name, p in net.named_parameters())
del model, expected, loaded, net
""")


# -- the memory bound ------------------------------------------------------------------------------
LAYERS, SIDE = 24, 1024  # 24 parameters of 4 MiB: 96 MiB whole
WHOLE, LARGEST = LAYERS * SIDE * SIDE * 4, SIDE * SIDE * 4
MIB = 1 << 20
BIG = f"""#pragma taas --gpus 2 --device cpu
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
mesh = init_device_mesh("cpu", (2,))
with torch.device("meta"):
    big = torch.nn.Sequential(*[torch.nn.Linear({SIDE}, {SIDE}, bias=False) for _ in range({LAYERS})])
for layer in big:
    fully_shard(layer, mesh=mesh)
fully_shard(big, mesh=mesh)
big.to_empty(device="cpu")
with torch.no_grad():
    for p in big.parameters():
        p.fill_(1.0)
del mesh, layer, p
dist.destroy_process_group()
"""


def _status(pid: int | str) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as lines:
        return {key: int(rest.split()[0]) * 1024 for key, rest in (line.split(":", 1) for line in lines)
                if key.startswith(("Rss", "Vm"))}


def test_the_kernel_keeps_one_copy_of_a_gathered_model(kernel):
    """The kernel's resident memory grows by the model once: the memory file rank 0 wrote, mapped
    shared (RssShmem), and no private copy of it (RssAnon)."""
    # not what is measured: the kernel's own imports of what the cell binds (fully_shard, init_device_mesh)
    _check(kernel, "import torch, torch.distributed.fsdp, torch.distributed.device_mesh")
    _ran(kernel, "#pragma taas --gpus 2 --device cpu\nx = 1")  # what a run's start gives back, given back first
    before = _status(kernel.pid)
    ran = _ran(kernel, BIG)
    assert f"big: FSDPSequential, came back whole as Sequential ({LAYERS} DTensors gathered" in ran.stream("stdout")
    _check(kernel, f"assert all(type(p) is torch.nn.Parameter and float(p.sum()) == {SIDE * SIDE} for p in big.parameters())")
    after = _status(kernel.pid)
    shared, private = after["RssShmem"] - before["RssShmem"], after["RssAnon"] - before["RssAnon"]
    try:
        assert 0.95 * WHOLE <= shared <= WHOLE + 8 * MIB, (shared / MIB, WHOLE / MIB)
        assert private <= 0.25 * WHOLE + 8 * MIB, (private / MIB, WHOLE / MIB)
    finally:
        _check(kernel, "del big, x")


GATHER = f"""
import json, os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from taas_magic.runspec import RunSpec
from taas_magic.transfer import sharded
from taas_magic.transfer.returns import CellResults

def status(key):
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(key + ":"))

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
with torch.device("meta"):
    big = torch.nn.Sequential(*[torch.nn.Linear({SIDE}, {SIDE}, bias=False) for _ in range({LAYERS})])
for layer in big:
    fully_shard(layer, mesh=mesh)
fully_shard(big, mesh=mesh)
big.to_empty(device="cpu")
with torch.no_grad():
    for p in big.parameters():
        p.fill_(1.0)
dist.barrier()
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")  # the peak (VmHWM) starts again from here
spec = RunSpec("r", (), "", "", "", "cpu", "rank0", False, 0, 0)
results, _ = sharded.bring_whole(CellResults({{"big": big}}, ["big"], []), {{}}, spec, dist.get_rank())
peak = status("VmHWM")
whole = results.namespace["big"]
kept = dist.get_rank() != 0 or all(type(p) is torch.nn.Parameter and float(p.sum()) == {SIDE * SIDE} for p in whole.parameters())
print(json.dumps({{"rank": dist.get_rank(), "grew": peak - before, "kept": kept}}), flush=True)
dist.destroy_process_group()
os._exit(0)  # as a taas rank leaves (rank/startup.py): torch 2.13's interpreter teardown aborts now and then (SIGABRT)
"""


def test_rank_0_holds_the_whole_model_once_and_each_rank_one_parameter_in_flight(tmp_path):
    """Over the gather itself, measured by each rank's own peak resident memory (VmHWM, reset just
    before): rank 0 grows by the whole model plus what is in flight, any other rank by what is in
    flight only (one parameter's all-gather at a time)."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("this kernel does not let a process reset its own peak (/proc/self/clear_refs)")
    script = tmp_path / "gather.py"
    script.write_text(GATHER)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    reports = {report["rank"]: report for report in fresh_ranks(
        lambda rank: [sys.executable, str(script)], timeout=240, cwd=str(ROOT),
        env=lambda rank: {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)})}
    in_flight = 2 * LARGEST + 8 * MIB
    assert reports[0]["kept"] and 0.95 * WHOLE <= reports[0]["grew"] <= WHOLE + in_flight, (reports[0]["grew"] / MIB, WHOLE / MIB)
    assert reports[1]["grew"] <= in_flight, (reports[1]["grew"] / MIB, in_flight / MIB)
