"""The Slurm engine on a real multi-node Slurm on this machine (tests/slurm/minislurm.py).

Three nodes of 2 fake GPUs each (GPU GRES over ``mknod`` devices: Slurm binds and hands out
``CUDA_VISIBLE_DEVICES`` as on a real cluster; the ranks compute on CPU with gloo). One kernel
holds a 2-node allocation for the module (``%taas cluster slurm --nodes 2 --gpus-per-node 2``);
the tests that queue, kill a kernel, lose a node or run inside a job make allocations of their
own. After each test no task, rank or keeper of this test process is left on any node, and the
shared allocation has no step running.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from taas_magic.output.budget import log_dir
from tests.four_ranks import (a_failed_collective_costs_the_cell_not_the_kept_ranks,
                              a_killed_rank_is_replaced_and_the_others_keep_their_state, every_rank_sees_rank_0s_writes,
                              the_hang_line_is_said_once_and_the_cell_completes)
from tests.kernel_client import Kernel, debug, started_here, wait_until_gone
from tests.panelled import ranks_on_two_hosts_stop_in_the_panel
from tests.profiled import kept_ranks_on_two_hosts_are_profiled, two_hosts_merge_on_measured_clocks
from tests.view_cells import CHANGES

pytestmark = pytest.mark.slurm


def cell_processes(keepers: bool = False) -> list[psutil.Process]:
    """Tasks and ranks on any node (all are this machine) started by this test process; the
    keepers (and their salloc) too when asked (an allocation held is not a cell's)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "name"]):
        if not started_here(proc):
            continue
        line = " ".join(proc.info["cmdline"] or [])
        if "--spare" in line and proc.info["name"] != "taas-rank":
            continue  # the local mode's warm spares, kept on purpose
        if "taas_magic.rank" in line or "taas_magic.launch.slurm.task" in line or "taas_magic.feed.worker" in line:
            found.append(proc)
        elif keepers and ("taas_magic.launch.slurm.allocation" in line or proc.info["name"] == "salloc"):
            found.append(proc)
    return found


def keepers_of(kernel: Kernel) -> list[psutil.Process]:
    """The kernel's allocation keepers and their salloc."""
    return [proc for proc in psutil.Process(kernel.pid).children(recursive=True)
            if "taas_magic.launch.slurm.allocation" in " ".join(proc.cmdline()) or proc.name() == "salloc"]


def steps(slurm, job: str) -> list[str]:
    out = slurm.run("squeue", "-h", "-s", "-j", job, "-o", "%i %j", check=False)
    return [line for line in out.splitlines() if line.strip() and not line.split()[0].endswith((".extern", ".interactive"))]


def job_of(kernel: Kernel) -> str:
    return re.search(r"Slurm job (\d+)", kernel.execute("%taas cluster").stream()).group(1)


@pytest.fixture(scope="module")
def attached(slurm, tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    kernel = Kernel(cwd=str(repo), env={"SLURM_CONF": str(slurm.conf)})
    ran = kernel.execute("%taas cluster slurm --nodes 2 --gpus-per-node 2 --time 30", timeout=120)
    assert ran.reply["status"] == "ok", ran.error_text()
    assert ran.stream().startswith("taas: attached; cluster: Slurm job"), ran.stream()
    kernel.repo = repo
    yield kernel
    job = job_of(kernel)
    kernel.shutdown()
    deadline = time.monotonic() + 30
    while any(line.startswith(job + " ") for line in slurm.jobs()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(line.startswith(job + " ") for line in slurm.jobs()), slurm.jobs()  # shutdown gave it back


@pytest.fixture(autouse=True)
def nothing_left_on_any_node():
    yield
    alive = wait_until_gone(cell_processes(), timeout=15)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"


ACROSS_NODES = """\
#pragma taas --gpus 4 --output all
import os, time, torch, torch.distributed as dist
dist.init_process_group("nccl", init_method="env://")
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "SLURM_PROCID", "SLURM_LOCALID",
         "SLURMD_NODENAME", "CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS")
print("env", *(f"{k}={os.environ.get(k)}" for k in names), flush=True)
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
if dist.get_rank() == 0:
    print("streamed before the end", flush=True)
    while not os.path.exists(GO_ON):  # the test makes it once the line has reached it
        time.sleep(0.01)
total = total.item()
dist.destroy_process_group()
total
"""


def test_four_ranks_over_two_nodes_all_reduce_and_bind_names(attached, slurm, tmp_path):
    go_on = tmp_path / "go-on"
    msg_id, started = attached.submit(ACROSS_NODES.replace("GO_ON", repr(str(go_on))))
    try:  # live, not from a log file afterwards: rank 0 waits until its line has come, however long that takes
        before = attached.wait_for_stream(msg_id, "[rank 0] streamed before the end", timeout=120)
    finally:
        go_on.touch()
    ran = attached.collect(msg_id, started)
    assert ran.reply["status"] == "ok", ran.error_text()
    out = "".join(m.content["text"] for m in before if m.type == "stream" and m.content["name"] == "stdout")
    out += ran.stream("stdout")
    envs = {int(rank): dict(pair.split("=", 1) for pair in rest.split())
            for rank, rest in re.findall(r"\[rank (\d)\] env (.*)", out)}
    assert sorted(envs) == [0, 1, 2, 3], out
    nodes = {env["SLURMD_NODENAME"] for env in envs.values()}
    assert len(nodes) == 2, out  # more GPUs than one node has: two nodes
    for rank, env in envs.items():
        assert env["RANK"] == env["SLURM_PROCID"] == str(rank)  # Slurm's own numbering
        assert env["LOCAL_RANK"] == env["SLURM_LOCALID"] and env["WORLD_SIZE"] == "4" and env["LOCAL_WORLD_SIZE"] == "2"
        # the node's GPUs as Slurm bound them to its tasks, in local order: cuda:LOCAL_RANK is this task's own
        assert env["CUDA_VISIBLE_DEVICES"].split(",")[int(env["LOCAL_RANK"])] == env["SLURM_STEP_GPUS"], env
        assert sorted(env["CUDA_VISIBLE_DEVICES"].split(",")) == ["0", "1"], env
    assert ran.result["text/plain"] == "10.0"  # the all-reduce of 1+2+3+4 across both nodes
    assert attached.execute("print(total)").stream("stdout").strip() == "10.0"
    assert steps(slurm, job_of(attached)) == []  # the cell's step ended with it


def test_a_profiled_cell_on_two_nodes_merges_both_ranks_on_measured_clocks(attached):
    two_hosts_merge_on_measured_clocks(attached)


def test_kept_ranks_on_two_nodes_are_profiled_cell_after_cell(attached):
    kept_ranks_on_two_hosts_are_profiled(attached)


def test_the_debugger_panel_stops_the_ranks_on_two_nodes_and_shows_each_ones_variables(attached):
    ranks_on_two_hosts_stop_in_the_panel(attached)


def test_gpus_auto_is_every_gpu_of_the_allocation(attached):
    ran = attached.execute("#pragma taas --gpus auto\nimport os\nint(os.environ['WORLD_SIZE'])", timeout=120)
    assert ran.reply["status"] == "ok", ran.error_text()
    assert ran.result["text/plain"] == "4"


def test_a_failing_rank_is_named_with_its_node(attached):
    ran = attached.execute(
        "#pragma taas --gpus 4\nimport os, time\n"
        "if os.environ['RANK'] == '3':\n    raise ValueError('bad shard on ' + os.environ['SLURMD_NODENAME'])\ntime.sleep(60)",
        timeout=120,
    )
    assert ran.reply["status"] == "error"
    text = ran.error_text()
    node = re.search(r"bad shard on (node\d)", text).group(1)
    assert f"rank 3 on {node} raised ValueError: bad shard on {node}" in text, text


def test_more_gpus_than_the_allocation_fails_at_once(attached):
    ran = attached.execute("#pragma taas --gpus 6\nprint('never')")
    assert ran.reply["status"] == "error"
    assert "--gpus 6 cannot be placed: Slurm job" in ran.error_text() and "has 4 GPU(s)" in ran.error_text()
    assert "never" not in ran.stream()


def test_interrupt_ends_every_rank_of_the_step_within_3_s(attached, slurm, tmp_path):
    """Each task interrupts its rank (one SIGINT: every cell's ``finally`` has its time), then the step ends."""
    msg_id, started = attached.submit(
        "#pragma taas --gpus 4 --output all\nimport os, time\ntry:\n    print('sleeping', flush=True)\n    time.sleep(120)\nfinally:\n"
        "    try:\n        time.sleep(0.5)\n        said = 'finally ran'\n    except KeyboardInterrupt:\n"
        "        said = 'finally cut short'\n"
        f"    open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w').write(said)\n")
    attached.wait_for_stream(msg_id, tuple(f"[rank {rank}] sleeping" for rank in range(4)), timeout=120)  # each in its try
    ranks = cell_processes()
    assert len([p for p in ranks if "-m taas_magic.rank" in " ".join(p.cmdline()) and p.name() != "taas-watchdog"]) == 4
    interrupted = time.monotonic()
    attached.manager.interrupt_kernel()
    ran = attached.collect(msg_id, started, timeout=60)
    alive = wait_until_gone(ranks, timeout=10)
    gone_after = time.monotonic() - interrupted
    assert ran.reply["status"] == "error" and ran.error["ename"] == "KeyboardInterrupt"
    assert not alive and gone_after < 3.0, (gone_after, alive)
    assert sorted((path.name, path.read_text()) for path in tmp_path.iterdir()) == [
        (f"rank{rank}", "finally ran") for rank in range(4)]
    assert steps(slurm, job_of(attached)) == []  # the step is over in Slurm too
    again = attached.execute("#pragma taas --gpus 4\n__import__('os').environ['WORLD_SIZE']", timeout=120)
    assert again.result["text/plain"] == "'4'"  # the GPUs were free again at once


def test_kept_ranks_stay_in_the_allocation_across_cells_until_released(attached, slurm):
    keep = "#pragma taas --gpus 4 --keep --output all\n"
    first = attached.execute(keep + "import os, torch, torch.distributed as dist\ndist.init_process_group('nccl')\n"
                             "mine = 10 * dist.get_rank()\nprint('pid', os.getpid(), os.environ['SLURMD_NODENAME'])\n")
    assert first.reply["status"] == "ok", first.error_text()
    assert "--keep: new ranks, kept after this cell" in first.stream()
    pids = dict(re.findall(r"\[rank (\d)\] pid (\d+ \S+)", first.stream()))
    assert len(pids) == 4
    second = attached.execute(keep + "t = torch.ones(1)\ndist.all_reduce(t)\n"
                              "print('pid', os.getpid(), os.environ['SLURMD_NODENAME'], 'mine', mine, 'sum', t.item())\n")
    assert second.reply["status"] == "ok", second.error_text()
    assert "--keep: cell 2 on the kept ranks" in second.stream() and "Slurm job" in second.stream()
    for rank, pid in pids.items():
        assert f"[rank {rank}] pid {pid} mine {10 * int(rank)} sum 4.0" in second.stream(), second.stream()
    a_failed_collective_costs_the_cell_not_the_kept_ranks(attached, keep, pids)
    a_killed_rank_is_replaced_and_the_others_keep_their_state(attached, keep, pids)
    assert steps(slurm, job_of(attached)), "the kept ranks' step ended with its cell"
    released = attached.execute("%taas release")
    assert "released the kept ranks (4 rank(s) on auto, Slurm job" in released.stream(), released.stream()
    deadline = time.monotonic() + 30
    while steps(slurm, job_of(attached)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not steps(slurm, job_of(attached)), "the kept ranks' step outlived their release"


def test_rank_1_writes_are_diverted_on_its_node(attached):
    ran = attached.execute(
        "#pragma taas --gpus 2\nimport os\nopen(f\"made-by-{os.environ['RANK']}.txt\", 'w').write('x')", timeout=120
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    assert (attached.repo / "made-by-0.txt").exists()
    assert not (attached.repo / "made-by-1.txt").exists()
    assert "rank 1" in ran.stream("stderr") and "made-by-1.txt" in ran.stream("stderr"), ran.stream()


def test_timeout_shows_every_ranks_stack(attached):
    ran = attached.execute(
        # --timeout counts from the launch: ranks 1 and 2 end in a second or two, more on a loaded machine
        "#pragma taas --gpus 4 --timeout 10\nimport os, time\n"
        "def wait_here():\n    time.sleep(60)\n"
        "if os.environ['RANK'] in ('0', '3'):\n    wait_here()",
        timeout=120,
    )
    assert ran.error["ename"] == "RunTimeout", ran.error_text()
    text = ran.error_text() + ran.stream()
    assert "ranks still running: 0, 3. Every rank was stopped." in text
    assert text.count("wait_here") >= 2, text  # the autopsy read both ranks' stacks on their nodes


DATA_CELL = """\
#pragma taas --gpus 2 --cpus 2 --output all
import os
seen = sorted(int(batch[0, 0]) for batch in loader)
print("seen", os.environ["RANK"], len(seen), flush=True)
"""


def test_data_workers_run_as_slurm_tasks(attached):
    setup = attached.execute(
        "import taas, torch\n"
        "loader = torch.utils.data.DataLoader(torch.arange(40.0).repeat_interleave(3).reshape(40, 3), batch_size=1)\n"
        "taas.register(loader)"
    )
    assert setup.reply["status"] == "ok", setup.error_text()
    try:
        ran = attached.execute(DATA_CELL, timeout=180)
    finally:
        attached.execute("taas.unregister(loader)")
    assert ran.reply["status"] == "ok", ran.error_text()
    out = ran.stream()
    placed = re.search(r"data workers as Slurm tasks on worker 0 on (node\d), worker 1 on (node\d)", out)
    assert placed and placed.group(1) != placed.group(2), out  # Slurm spreads the workers' step over both nodes,
    assert "prepared elements travel from the workers' nodes to" in out, out  # so one worker's reach the ranks' node
    # through the kernel (the ranks' step is packed on one node)
    assert "[rank 0] seen 0 20" in out and "[rank 1] seen 1 20" in out, out


def test_a_detached_run_is_attached_to_waited_for_and_logged_as_locally(attached):
    ran = attached.execute("#pragma taas --gpus 2 --detach\nimport time\n"
                           "for i in range(30):\n    print('tick', i, flush=True)\n    time.sleep(0.05)\n"
                           "answer = 41 + 1", timeout=120)
    assert ran.reply["status"] == "ok", ran.error_text()
    run_id = re.search(r"run ([0-9a-f]{12})", json.dumps([m.content for m in ran.messages])).group(1)
    time.sleep(0.5)  # lines printed before anyone attaches
    shown = attached.execute(f"%taas attach {run_id}", timeout=120).stream("stdout")
    ticks = [int(n) for n in re.findall(r"^tick (\d+)$", shown, flags=re.MULTILINE)]
    assert ticks == list(range(30)), shown  # the backlog, then the live tail, nothing missing
    waited = attached.execute("%taas wait", timeout=120)
    assert waited.reply["status"] == "ok", waited.error_text()
    assert attached.execute("answer").result["text/plain"] == "42"
    path = os.path.join(log_dir(), f"{run_id}.run.jsonl")
    entries = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert "Slurm job" in entries[0]["text"] and entries[-1]["kind"] == "end" and entries[-1]["text"] == "ok"
    assert "".join(entry["text"] for entry in entries if entry["kind"] == "out") == "".join(f"tick {i}\n" for i in range(30))


def test_interrupt_while_queued_cancels_the_request(attached, slurm, new_kernel):
    kernel = new_kernel(env={"SLURM_CONF": str(slurm.conf)})
    msg_id, started = kernel.submit("%taas cluster slurm --nodes 3 --gpus-per-node 2")  # 2 of 3 nodes are held
    kernel.wait_for(msg_id, lambda kind, content: "PENDING" in str(content.get("data", {})), "the queue state", timeout=60)
    before = set(slurm.jobs())
    kernel.manager.interrupt_kernel()
    ran = kernel.collect(msg_id, started, timeout=30)
    assert ran.reply["status"] == "error"
    assert "interrupted while the allocation was queued: it was cancelled, nothing is held" in ran.error_text()
    assert [line for line in slurm.jobs() if "PENDING" in line] == [], (before, slurm.jobs())
    assert wait_until_gone(keepers_of(kernel), timeout=10) == []
    assert "cluster: none" in kernel.execute("%taas cluster").stream()


BREAK_ON_ANOTHER_NODE = """\
#pragma taas --gpus 4
import os, torch, torch.distributed as dist
dist.init_process_group("nccl", init_method="env://")
if dist.get_rank() == 2:
    breakpoint()
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
dist.destroy_process_group()
total.item()
"""


def test_a_breakpoint_on_the_second_node_prompts_in_the_cell(attached, slurm):
    """Rank 2, a Slurm task on the second node, stops: its prompt comes through its task's connection
    to the kernel's hub (authenticated with the run's key), and ``c`` lets the run end."""
    session = debug(attached, BREAK_ON_ANOTHER_NODE, ["p dist.get_rank(), os.environ['SLURM_PROCID']", "c"])
    assert session.error is None, session.error
    assert session.prompts == ["(Pdb rank 2) "] * 2, session.prompts
    assert "(2, '2')" in session.text and re.search(r"> Cell In\[\d+\], line 6, in <module>", session.texts[0])
    assert session.execution.result["text/plain"] == "10.0"
    assert steps(slurm, job_of(attached)) == []


def test_ranks_on_both_nodes_see_what_rank_0_wrote_after_a_barrier(attached):
    """writes/refresh.py in a Slurm step whose nodes see the repository: ranks 1-3 look every path up first, rank 0
    changes them, and after a barrier every rank on both nodes sees rank 0's changes."""
    folder = attached.repo / "view"
    folder.mkdir()
    ran = attached.execute(f"import os\nos.chdir({str(folder)!r})\n" + CHANGES + "seed()")
    assert ran.reply["status"] == "ok", ran.error_text()
    try:
        every_rank_sees_rank_0s_writes(attached)
    finally:
        attached.execute(f"os.chdir({str(attached.repo)!r})")


def test_the_hang_line_names_where_ranks_on_both_nodes_are_while_they_wait(attached):
    the_hang_line_is_said_once_and_the_cell_completes(attached)
