"""What rank 0 binds, and what the notebook must hold afterwards: a table over a real kernel.

Each case runs a taas cell, then a plain cell of assertions in the notebook. A case
lists the names that must be reported as not coming back; every other name must arrive.
"""

import os

import pytest

NET = """\
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", init_method="env://")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
"""

TRAIN = """\
opt = torch.optim.SGD({params}, lr=0.1, momentum=0.9)
for step in range(3):
    opt.zero_grad()
    loss = {net}(torch.randn(16, 4)).pow(2).mean()
    loss.backward()
    opt.step()
w = 3
"""

CASES = {
    "ddp_without_destroy": (
        "#pragma taas --device cpu --gpus 2\n" + NET + "ddp_model = DDP(model)\n" + TRAIN.format(params="ddp_model.parameters()", net="ddp_model")
        + "ddp_model\n",
        """
assert ddp_model is model and type(model).__name__ == "Sequential", type(ddp_model)
assert opt.param_groups[0]["params"][0] is model[0].weight  # the optimizer holds the model's parameters
assert opt.state[model[0].weight]["momentum_buffer"].shape == (8, 4)
assert w == 3 and {out} is model
""",
        (),
        "ddp_model: DistributedDataParallel, came back as its module",
    ),
    "ddp_with_destroy": (
        "#pragma taas --device cpu --gpus 2\n" + NET + "ddp_model = DDP(model)\n" + TRAIN.format(params="ddp_model.parameters()", net="ddp_model")
        + "dist.destroy_process_group()\nddp_model\n",
        """
assert ddp_model is model and opt.param_groups[0]["params"][-1] is model[2].bias and {out} is model
""",
        (),
        "ddp_model: DistributedDataParallel, came back as its module",
    ),
    "compiled_module_scheduler_and_scaler": (
        "#pragma taas --device cpu --gpus 1\n" + NET + "compiled = torch.compile(model, backend='eager')\n"
        + TRAIN.format(params="compiled.parameters()", net="compiled")
        + "scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)\nscheduler.step()\n"
        + "scaler = torch.amp.GradScaler('cpu', init_scale=1024.0)\nscheduler.get_last_lr()[0]\n",
        """
assert compiled is model and type(model).__name__ == "Sequential"
assert scheduler.optimizer is opt and opt.param_groups[0]["lr"] == 0.05 and {out} == 0.05
assert scaler.get_scale() == 1024.0
""",
        (),
        "compiled: OptimizedModule, came back as its module",
    ),
    "fsdp_whole_and_sharded": (
        """#pragma taas --device cpu --gpus 2
import torch, torch.distributed as dist, warnings
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
warnings.simplefilter("ignore", FutureWarning)  # NO_SHARD is deprecated in favour of DDP, and still works
dist.init_process_group("gloo", init_method="env://")
inner = torch.nn.Linear(4, 4)
whole = FSDP(inner, sharding_strategy=ShardingStrategy.NO_SHARD, device_id=torch.device("cpu"), use_orig_params=True)
sharded = FSDP(torch.nn.Linear(4, 4), device_id=torch.device("cpu"))
for net in (whole, sharded):
    net(torch.randn(2, 4)).sum().backward()
whole
""",
        """
assert whole is inner and {out} is inner and [name for name, _ in inner.named_parameters()] == ["weight", "bias"]
assert inner(torch.ones(1, 4)).shape == (1, 4) and "sharded" not in dir()
""",
        ("sharded",),
        "whole: FullyShardedDataParallel, came back as its module",
    ),
    "ten_thousand_small_tensors_and_numpy": (
        """#pragma taas --device cpu --gpus 1
import numpy as np, torch
state = {f"t{i}": torch.full((3,), float(i)) for i in range(10_000)}
tied = state["t7"]
arrays = {"a": np.arange(12, dtype=np.int32).reshape(3, 4), "b": np.linspace(0, 1, 5), "f": np.asfortranarray(np.ones((2, 3)))}
len(state)
""",
        """
assert len(state) == 10_000 and float(state["t9999"][2]) == 9999.0
assert tied is state["t7"]
assert arrays["a"].dtype == np.int32 and arrays["a"][2, 3] == 11 and arrays["b"][-1] == 1.0
assert arrays["f"].flags.f_contiguous and arrays["f"].sum() == 6
assert {out} == 10_000
""",
        (),
        None,
    ),
    "a_400_mb_tensor": (
        "#pragma taas --device cpu --gpus 1\nimport torch\nbig = torch.ones(100 * 2**20)\nbig[-1] = 7\nbig.shape\n",
        """
assert big.shape == (100 * 2**20,) and float(big[-1]) == 7.0 and float(big[:5].sum()) == 5.0
assert tuple({out}) == (100 * 2**20,)
big.add_(1)  # the kernel's tensor is writable, and its own
assert float(big[0]) == 2.0
del big
""",
        (),
        None,
    ),
    "a_class_defined_in_the_cell_and_one_the_kernel_cannot_load": (
        """#pragma taas --device cpu --gpus 1
import os
class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y
class RankOnly:
    def __init__(self):
        self.made_in = os.environ["RANK"]
    def __setstate__(self, state):
        if "RANK" not in os.environ:
            raise RuntimeError("this object only loads in a rank")
        self.__dict__.update(state)
p = Point(1, 2)
only_here = RankOnly()
holder = {"it": only_here}
after = [p.x + p.y]
p
""",
        """
assert (p.x, p.y) == (1, 2) and type(p).__name__ == "Point"
assert after == [3] and {out} is p
assert "only_here" not in dir() and "holder" not in dir()
""",
        ("only_here", "holder"),
        None,
    ),
}


CASES_REASONS = {
    "fsdp_whole_and_sharded": "holds only this rank's shard of each parameter; gather a full state dict",
    "a_class_defined_in_the_cell_and_one_the_kernel_cannot_load":
        "RuntimeError: this object only loads in a rank), holder (dict: shares an object with only_here",
}


@pytest.mark.minimums
@pytest.mark.parametrize("case", list(CASES))
def test_what_rank_0_binds_arrives_in_the_notebook(kernel, case):
    cell, check, lost, note = CASES[case]
    ran = kernel.execute(cell, timeout=300)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    stderr = ran.stream("stderr")
    if lost:
        assert "could not come back" in stderr, stderr
        reported = stderr.split("could not come back", 1)[1].splitlines()[0]
        for name in lost:
            assert f" {name} (" in reported, reported
        assert CASES_REASONS[case] in reported, reported
    else:
        assert "could not come back" not in stderr, stderr
    if note is not None:  # information, not an error: stdout, which Jupyter does not paint red
        assert f"taas: {note}" in ran.stream("stdout") and note not in stderr, ran.stream()
    checked = kernel.execute(check.replace("{out}", f"Out[{ran.reply['execution_count']}]"))
    assert checked.reply["status"] == "ok", checked.error_text()


def test_untouched_shipped_tensors_keep_their_identity_and_storage(kernel):
    kernel.execute("import torch\ndata = torch.arange(1_000_000, dtype=torch.float32)\nseen = id(data)\n"
                   "net = torch.nn.Linear(2, 2)\nnet_id = id(net)")
    ran = kernel.execute("#pragma taas --device cpu --gpus 1\nhead = data[:10]\nmean = float(data.mean())\nopt = torch.optim.SGD(net.parameters(), lr=0.1)")
    assert ran.reply["status"] == "ok", ran.error_text()
    checked = kernel.execute("""
assert id(data) == seen  # untouched: not sent back at all
assert head.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()  # a view of the notebook's own tensor
assert opt.param_groups[0]["params"][0] is net.weight  # net came back with opt, so opt holds net's parameters
assert torch.equal(net.weight, net.weight) and mean == 499999.5
""")
    assert checked.reply["status"] == "ok", checked.error_text()


@pytest.mark.parametrize("file_bytes", [4 << 20, 1024], ids=["in the frame", "through a file"])
def test_in_place_changes_come_back_and_the_rest_stays(kernel, file_bytes):
    kernel.execute(f"import torch\n%config TaasMagics.closure_file_bytes = {file_bytes}\n"
                   "weights = torch.zeros(100_000)\nfrozen = torch.ones(100_000)\nrewritten = torch.ones(100_000)\n"
                   "ids = (id(frozen), id(rewritten))")
    try:
        # frozen is only read; rewritten is written with the bytes it had: neither comes back
        ran = kernel.execute("#pragma taas --device cpu --gpus 1\nweights.add_(2)\nrewritten.mul_(1)\nfloat(frozen.sum())")
        assert ran.reply["status"] == "ok", ran.error_text()
        checked = kernel.execute("assert float(weights.sum()) == 200_000.0 and (id(frozen), id(rewritten)) == ids")
        assert checked.reply["status"] == "ok", checked.error_text()
    finally:
        kernel.execute("%config TaasMagics.closure_file_bytes = 4 << 20\ndel weights, frozen, rewritten")


def _memory_files(pid: int) -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith((f"taas-result-{pid}-", f"taas-closure-{pid}-"))]


def test_memory_files_are_gone_after_success_failure_and_interrupt(kernel):
    kernel.execute("import torch\nshipped = torch.ones(2 * 2**20)")  # 8 MB: through a file both ways
    ok = kernel.execute("#pragma taas --device cpu --gpus 1\nback = shipped * 2")
    assert ok.reply["status"] == "ok", ok.error_text()
    assert not _memory_files(kernel.pid)
    failed = kernel.execute("#pragma taas --device cpu --gpus 2\nimport os, time\nback = shipped * 3\n"
                            "if os.environ['RANK'] == '1':\n    time.sleep(1)\n    raise ValueError('late')\n")
    assert failed.reply["status"] == "error"
    assert not _memory_files(kernel.pid)
    msg_id, started = kernel.submit("#pragma taas --device cpu --gpus 2\nimport time\nprint('going', float(shipped[0]), flush=True)\ntime.sleep(60)")
    kernel.wait_for_stream(msg_id, "going")
    kernel.manager.interrupt_kernel()
    interrupted = kernel.collect(msg_id, started)
    assert interrupted.reply["status"] == "error"
    assert not _memory_files(kernel.pid)
    kernel.execute("del shipped, back")


def test_files_of_a_killed_kernel_are_swept(kernel):
    dead = 2**22 + 17  # above the default pid_max of small systems; checked below
    assert not os.path.exists(f"/proc/{dead}")
    path = f"/dev/shm/taas-result-{dead}-feedbeef-x"
    with open(path, "wb") as handle:
        handle.write(b"left by a kernel that died")
    ran = kernel.execute("#pragma taas --device cpu --gpus 1\nx = 1")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert not os.path.exists(path)


@pytest.mark.minimums
def test_a_traceback_shows_the_lines_of_earlier_cells(kernel):
    defined = kernel.execute("def helper(v):\n    if v > 1:\n        raise ValueError(f'too big: {v}')\n    return v")
    cell_number = defined.reply["execution_count"]
    ran = kernel.execute("#pragma taas --device cpu --gpus 1\nx = 1\nhelper(x + 1)")
    assert ran.reply["status"] == "error"
    text = ran.error_text()
    assert f"Cell In[{cell_number}], line 3, in helper" in text, text
    assert "raise ValueError(f'too big: {v}')" in text, text
