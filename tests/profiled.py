"""``--profile`` checked the same way on every engine (tests/kernel, tests/ray, tests/slurm): a DDP cell on gloo,
its merged trace holding every rank as ``rank K``, each rank's breakdown in the cell."""

from __future__ import annotations

import json
import os
import re
import shutil

LOCAL = "#pragma taas --device cpu --gpus 2 --profile 2"
DDP = """\
{head}
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


def saved(ran) -> str:
    """The merged trace's path the cell printed."""
    found = re.search(r"--profile: .*?: (\S+trace\.json) \(", ran.stream())
    assert found, ran.stream()
    return found.group(1)


def trace_of(path: str) -> dict:
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def ranks_in(path: str) -> dict[int, str]:
    return {event["pid"]: event["args"]["name"] for event in trace_of(path)["traceEvents"]
            if event.get("ph") == "M" and event.get("name") == "process_name"}


def a_profiled_ddp_cell_merges_every_rank(kernel, head: str = LOCAL, timeout: float = 120) -> tuple[str, str]:
    """Run the DDP cell under the pragma line ``head`` (2 ranks, ``--profile 2``); the trace's path and the cell's
    text, once checked."""
    ran = kernel.execute(DDP.format(head=head), timeout=timeout)
    assert ran.reply["status"] == "ok", ran.error_text()
    text, path = ran.stream(), saved(ran)
    assert "--profile: 2 steps after the first, 2 of 2 ranks:" in text, text
    assert ranks_in(path) == {0: "rank 0", 1: "rank 1"}
    steps = {(event["pid"], event["name"]) for event in trace_of(path)["traceEvents"]
             if event.get("name", "").startswith("ProfilerStep#")}
    assert {(0, "ProfilerStep#1"), (1, "ProfilerStep#2")} <= steps and (0, "ProfilerStep#0") not in steps
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: working \d+%, communicating \d+%, idle \d+% of [\d.]+ [mµ]s; top: \S+", text), text
        alone = trace_of(os.path.join(os.path.dirname(path), "ranks", f"rank{rank}.json"))
        assert alone["distributedInfo"]["rank"] == rank
    return path, text


def remove_run(path: str) -> None:
    """A run's profile folder, made where a shared kernel runs (the repository's root): gone after the test."""
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def kept_ranks_are_profiled_cell_after_cell(kernel, head: str = LOCAL) -> list[str]:
    """Kept ranks (``head`` with ``--keep``): profiled twice, each cell its own folder, then an unprofiled kept cell
    finds one taas hook on the optimizer (rank/steps.py's, for the rank's life: none added per cell) and no profiler
    running; released at the end. The traces' paths."""
    try:
        first, _ = a_profiled_ddp_cell_merges_every_rank(kernel, head + " --keep")
        kept = head.replace("--profile 2", "--profile 1") + " --keep\n"
        again = kernel.execute(kept + "for step in range(4):\n    optimizer.zero_grad()\n"
                               "    model(torch.randn(32, 64)).sum().backward()\n    optimizer.step()\n", timeout=120)
        assert again.reply["status"] == "ok", again.error_text()
        assert "--profile: 1 step after the first, 2 of 2 ranks:" in again.stream(), again.stream()
        assert first != saved(again) and ranks_in(saved(again)) == {0: "rank 0", 1: "rank 1"}
        plain = kernel.execute(kept.replace(" --profile 1", "") +
                               "from torch.optim.optimizer import _global_optimizer_post_hooks\n"
                               "import torch.autograd.profiler as profiler\n"
                               "ours = [hook for hook in _global_optimizer_post_hooks.values() if hook.__module__.startswith('taas_magic')]\n"
                               "print('hooks', len(ours), 'profiling', profiler._is_profiler_enabled)\n"
                               "del ours\n", timeout=120)
        assert plain.reply["status"] == "ok", plain.error_text()
        assert "hooks 1 profiling False" in plain.stream() and "--profile" not in plain.stream(), plain.stream()
        return [first, saved(again)]
    finally:
        kernel.execute("%taas release")


TWO_HOSTS = "#pragma taas --gpus 2 --per-host 1 --profile 2"


def two_hosts_merge_on_measured_clocks(kernel) -> None:
    """A profiled DDP cell with a rank on each of two hosts: both merged, each clock's offset measured and bounded."""
    path, _ = a_profiled_ddp_cell_merges_every_rank(kernel, TWO_HOSTS)
    try:
        about = trace_of(path)["taas"]
        assert about["clocks"].startswith("measured offset") and set(about["clock_bound_us"]) == {"0", "1"}
    finally:
        remove_run(path)


def kept_ranks_on_two_hosts_are_profiled(kernel) -> None:
    for path in kept_ranks_are_profiled_cell_after_cell(kernel, TWO_HOSTS):
        remove_run(path)
