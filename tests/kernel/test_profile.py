"""``--profile [N]`` over a real kernel: a DDP cell on gloo, its merged trace holding both ranks, the breakdown in
the cell; a cell with no step marks profiled whole; kept ranks profiled cell after cell, and clean after."""

import json
import os
import re
import stat

import pytest

from tests.kernel_client import Kernel

DDP = """\
#pragma taas --device cpu --gpus 2 --profile 2{keep}
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(64, 64))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    optimizer.zero_grad()
    model(torch.randn(32, 64)).sum().backward()
    optimizer.step()
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A kernel of its own, started in a folder of its own: the notebook's folder, where the traces land."""
    folder = tmp_path_factory.mktemp("notebook")
    own = Kernel(cwd=str(folder))
    own.folder = str(folder)
    yield own
    own.shutdown()


def saved(ran) -> str:
    """The merged trace's path the cell printed."""
    found = re.search(r"--profile: .*?: (\S+trace\.json) \(", ran.stream())
    assert found, ran.stream()
    return found.group(1)


def ranks_in(path: str) -> dict[int, str]:
    with open(path, encoding="utf-8") as file:
        trace = json.load(file)
    return {event["pid"]: event["args"]["name"] for event in trace["traceEvents"]
            if event.get("ph") == "M" and event.get("name") == "process_name"}


def test_a_ddp_cell_merged_with_both_ranks_and_its_breakdown(kernel):
    ran = kernel.execute(DDP.format(keep=""))
    assert ran.reply["status"] == "ok", ran.error_text()
    text = ran.stream()
    path = saved(ran)
    assert os.path.dirname(os.path.dirname(os.path.dirname(path))) == kernel.folder
    assert "--profile: 2 steps after the first, 2 of 2 ranks:" in text
    assert ranks_in(path) == {0: "rank 0", 1: "rank 1"}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    with open(path, encoding="utf-8") as file:
        events = json.load(file)["traceEvents"]
    steps = {(event["pid"], event["name"]) for event in events if event.get("name", "").startswith("ProfilerStep#")}
    assert {(0, "ProfilerStep#1"), (1, "ProfilerStep#2")} <= steps and (0, "ProfilerStep#0") not in steps
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: working \d+%, communicating \d+%, idle \d+% of [\d.]+ ms; top: \S+", text), text
        with open(os.path.join(os.path.dirname(path), "ranks", f"rank{rank}.json"), encoding="utf-8") as file:
            assert json.load(file)["distributedInfo"]["rank"] == rank


def test_a_cell_without_step_marks_is_profiled_whole(kernel):
    ran = kernel.execute("#pragma taas --device cpu --gpus 2 --profile\nimport torch\n"
                         "x = torch.randn(200, 200) @ torch.randn(200, 200)\n")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert "--profile: the whole cell" in ran.stream()
    assert ranks_in(saved(ran)) == {0: "rank 0", 1: "rank 1"}


def test_kept_ranks_profiled_cell_after_cell_and_clean_after(kernel):
    try:
        first = kernel.execute(DDP.format(keep=" --keep"))
        assert first.reply["status"] == "ok", first.error_text()
        again = kernel.execute("#pragma taas --device cpu --gpus 2 --keep --profile 1\nfor step in range(4):\n"
                               "    optimizer.zero_grad()\n    model(torch.randn(32, 64)).sum().backward()\n"
                               "    optimizer.step()\n")
        assert again.reply["status"] == "ok", again.error_text()
        assert "--profile: 1 step after the first, 2 of 2 ranks:" in again.stream()
        assert saved(first) != saved(again) and ranks_in(saved(again)) == {0: "rank 0", 1: "rank 1"}
        # the next kept cell, unprofiled: no hook left on the optimizer, no profiler running
        plain = kernel.execute("#pragma taas --device cpu --gpus 2 --keep\n"
                               "from torch.optim.optimizer import _global_optimizer_post_hooks as hooks\n"
                               "import torch.autograd.profiler as profiler\n"
                               "print('hooks', len(hooks), 'profiling', profiler._is_profiler_enabled)\n")
        assert plain.reply["status"] == "ok", plain.error_text()
        assert "hooks 0 profiling False" in plain.stream() and "--profile" not in plain.stream()
    finally:
        kernel.execute("%taas release")
