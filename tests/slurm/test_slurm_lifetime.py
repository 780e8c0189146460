"""The Slurm engine's allocations over their lifetime: a kernel killed, a node lost, a kernel inside a
job, a search on the allocation's GPUs. Each test makes its own allocation on the session's Slurm."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import psutil
import pytest

from tests.kernel_client import Kernel, wait_until_gone
from tests.slurm.test_slurm import cell_processes, job_of

pytestmark = pytest.mark.slurm


@pytest.fixture(autouse=True)
def every_node_idle_first(slurm):
    """Each test asks for an allocation of its own: the last test's nodes have finished with its job first
    (a node still completing one would leave the request pending until the scheduler's next pass)."""
    slurm.wait_idle(slurm.names, timeout=60)


def job_known(slurm, job: str) -> bool:
    return any(line.split()[0] == job for line in slurm.jobs())


def wait_job_gone(slurm, job: str, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while job_known(slurm, job) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not job_known(slurm, job)


def test_the_kernel_killed_releases_its_allocation_and_leaves_nothing(slurm):
    kernel = Kernel(env={"SLURM_CONF": str(slurm.conf)})
    try:
        assert kernel.execute("%taas cluster slurm --nodes 2 --gpus-per-node 2", timeout=120).reply["status"] == "ok"
        job = job_of(kernel)
        msg_id, _ = kernel.submit("#pragma taas --gpus 4\nimport time\nprint('up', flush=True)\ntime.sleep(300)")
        kernel.wait_for_stream(msg_id, "up", timeout=120)
        assert len(cell_processes()) >= 8  # a task and a rank for each of the 4
        psutil.Process(kernel.pid).send_signal(signal.SIGKILL)
    finally:
        kernel.shutdown()
    assert wait_job_gone(slurm, job), slurm.jobs()  # the keeper's lifeline broke: salloc gave the allocation back
    alive = wait_until_gone(cell_processes(keepers=True), timeout=30)
    assert not alive, f"left behind after the kernel died: {[(p.pid, p.cmdline()) for p in alive]}"


def test_cluster_shows_the_allocation_and_off_releases_it(slurm):
    kernel = Kernel(env={"SLURM_CONF": str(slurm.conf)})
    try:
        ran = kernel.execute("%taas cluster slurm -N 1 --gpus-per-node 1 --time 10", timeout=120)
        assert ran.reply["status"] == "ok", ran.error_text()
        job = job_of(kernel)
        shown = kernel.execute("%taas cluster").stream()
        made = rf"Slurm job {job} \(made by this session\), partition gpu, 1 node\(s\), 1 GPU, time left 0?:?[0-9]"
        assert re.search(made, shown), shown
        assert re.search(r"  node\d: 1 GPU, 1 CPU, (mixed|allocated)", shown), shown
        keepers = [proc for proc in psutil.Process(kernel.pid).children(recursive=True) if proc.name() == "salloc"]
        assert len(keepers) == 1
        assert "local mode" in kernel.execute("%taas cluster off").stream()
        assert wait_job_gone(slurm, job, timeout=15), slurm.jobs()
        assert wait_until_gone(keepers, timeout=10) == []
        assert "cluster: none" in kernel.execute("%taas cluster").stream()
    finally:
        kernel.shutdown()


RESTARTED = """\
#pragma taas --gpus 4 --restarts 1 --output all
import os, time, torch.distributed as dist, taas
dist.init_process_group("gloo", init_method="env://")
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
state = taas.load_checkpoint() or {"step": 0}
if attempt == 0:
    taas.save_checkpoint({"step": 5})
dist.barrier()
print("attempt", attempt, "node", os.environ["SLURMD_NODENAME"], flush=True)
if attempt == 0:
    time.sleep(120)  # the test takes rank 3's node away meanwhile
nodes = [None] * 4
dist.all_gather_object(nodes, os.environ["SLURMD_NODENAME"])
resumed, seen_attempt, attempt_nodes = state["step"], attempt, sorted(set(nodes))
dist.destroy_process_group()
"""


def test_a_lost_node_is_named_and_the_restart_runs_on_the_nodes_left(slurm, tmp_path):
    kernel = Kernel(env={"SLURM_CONF": str(slurm.conf)})
    lost = None
    try:
        ran = kernel.execute("%taas cluster slurm --nodes 3 --gpus-per-node 2", timeout=120)
        assert ran.reply["status"] == "ok", ran.error_text()
        assert kernel.execute(f"%config TaasMagics.checkpoint_dir = {str(tmp_path)!r}").reply["status"] == "ok"
        msg_id, started = kernel.submit(RESTARTED)
        seen = kernel.wait_for_stream(msg_id, ("[rank 3] attempt 0 node",), timeout=120)
        text = "".join(m.content.get("text", "") for m in seen if m.type == "stream")
        lost = re.search(r"\[rank 3\] attempt 0 node (node\d)", text).group(1)
        slurm.lose_node(lost)
        ran = kernel.collect(msg_id, started, timeout=180)
        assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
        err = ran.stream()
        assert re.search(r"attempt 1 of 2 failed: rank [23] was killed by SIGKILL", err), err  # rank 3's node held 2 and 3
        assert f"node {lost} of Slurm job" in err and "went away; the next attempt runs on the nodes left" in err, err
        result = kernel.execute("resumed, seen_attempt, attempt_nodes").result["text/plain"]
        assert result.startswith("(5, 1, [") and lost not in result, result
        assert f"lost: {lost}" in kernel.execute("%taas cluster").stream()
    finally:
        kernel.shutdown()
        if lost is not None:
            slurm.restore_node(lost)


def test_a_kernel_inside_a_job_uses_it_and_never_cancels_it(slurm):
    holder = subprocess.Popen(["salloc", "--nodes=1", "--gpus-per-node=2", "--ntasks-per-node=2", "--no-kill", "cat"],
                              stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=slurm.env(), text=True)
    try:
        job = holder.stderr.readline().split()[-1]
        kernel = Kernel(env={"SLURM_CONF": str(slurm.conf), "SLURM_JOB_ID": job, "TAAS_CLUSTER": "slurm"})
        try:
            status = kernel.execute("%taas cluster").stream()
            assert f"Slurm job {job} (this kernel's own job)" in status, status  # attached at load ($TAAS_CLUSTER=slurm)
            assert kernel.execute("%taas cluster off").reply["status"] == "ok"
            ran = kernel.execute("%taas cluster slurm", timeout=60)  # no options: the job it runs inside
            assert f"Slurm job {job} (this kernel's own job)" in ran.stream(), ran.stream()
            ran = kernel.execute("#pragma taas --gpus 2\nimport os\nos.environ['SLURM_JOB_ID'], os.environ['WORLD_SIZE']",
                                 timeout=120)
            assert ran.result["text/plain"] == f"('{job}', '2')", ran.error_text()
            assert kernel.execute("%taas cluster off").reply["status"] == "ok"
        finally:
            kernel.shutdown()
        time.sleep(1)
        assert job_known(slurm, job)  # taas never cancels a job it did not make
    finally:
        holder.stdin.close()
        holder.wait(30)
        holder.stderr.close()


def test_a_search_places_its_trials_on_the_allocations_gpus(slurm):
    pytest.importorskip("optuna")
    kernel = Kernel(env={"SLURM_CONF": str(slurm.conf)})
    try:
        assert kernel.execute("%taas cluster slurm --nodes 2 --gpus-per-node 2", timeout=120).reply["status"] == "ok"
        cell = ("#pragma taas --gpus 2 --trials 4 --sampler random\n"
                "import os, time, taas, torch.distributed as dist\n"
                "dist.init_process_group('gloo')\n"
                "t = taas.trial()\n"
                "x = t.suggest_float('x', -1.0, 1.0)\n"
                "time.sleep(1.0)\n"
                "taas.report(0, loss=x * x)\n"
                "dist.destroy_process_group()\n")
        ran = kernel.execute(cell, timeout=300)
        assert ran.reply["status"] == "ok", ran.error_text()
        assert "2 at a time (the cluster's 4 GPU(s))" in ran.stream(), ran.stream()
        rows = json.loads(kernel.execute("import taas\nprint(taas.trials()[['state']].to_json(orient='records'))").stream())
        assert [row["state"] for row in rows] == ["complete"] * 4
    finally:
        kernel.shutdown()
