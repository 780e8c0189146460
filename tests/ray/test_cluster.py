"""The cluster mode over a real Ray cluster of several nodes on this machine.

``ray.cluster_utils.Cluster`` starts a real head node and real worker nodes (their own
raylets): two nodes declaring 2 GPUs each (CPU ranks with gloo, as there is no CUDA here)
and one CPU-only node. A real kernel attaches with ``%taas cluster ADDRESS`` and runs
``--gpus 4`` across the two "hosts". One cluster and one kernel serve the module; each
test leaves no rank process and no agent actor behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.four_ranks import (a_failed_collective_costs_the_cell_not_the_kept_ranks,
                              a_killed_rank_is_replaced_and_the_others_keep_their_state, every_rank_sees_rank_0s_writes,
                              the_hang_line_is_said_once_and_the_cell_completes)
from tests.kernel_client import Kernel, debug, started_here, wait_until_gone
from tests.panelled import ranks_on_two_hosts_stop_in_the_panel
from tests.profiled import kept_ranks_on_two_hosts_are_profiled, two_hosts_merge_on_measured_clocks
from tests.view_cells import CHANGES

pytestmark = pytest.mark.ray
cluster_utils = pytest.importorskip("ray.cluster_utils", reason='the cluster mode needs Ray: pip install "taas-magic[ray]"')


def cell_processes() -> list[psutil.Process]:
    """Ranks, data workers and agents anywhere on this machine (every simulated host is on
    it) that this test process started; local-mode warm spares that other tests' kernels keep are
    not a cell's."""
    found = []
    for proc in psutil.process_iter(["cmdline", "name"]):
        if not started_here(proc):
            continue
        try:
            line = " ".join(proc.info["cmdline"] or [])
        except psutil.Error:
            continue
        if "--spare" in line and proc.info["name"] != "taas-rank":
            continue  # a spare still warming or waiting, or its watchdog (an adopted spare is named taas-rank)
        if "taas_magic.rank" in line or "taas_magic.feed.worker" in line or "HostAgent" in line:
            found.append(proc)
    return found


def _described(proc: psutil.Process) -> str:
    """``pid name (parent ppid): command line``, or "" for a process that is gone."""
    try:
        return f"{proc.pid} {proc.name()} (parent {proc.ppid()}): " + " ".join(proc.cmdline())
    except psutil.Error:
        return ""


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2})
    cluster.add_node(num_cpus=1, num_gpus=2)
    cluster.add_node(num_cpus=2, num_gpus=0)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def attached(ray_cluster):
    kernel = Kernel()
    ran = kernel.execute(f"%taas cluster {ray_cluster.address}", timeout=120)
    assert ran.reply["status"] == "ok", ran.error_text()
    assert ran.stream().startswith("taas: attached; cluster: Ray at"), ran.stream()  # and no import noise
    yield kernel
    kernel.shutdown()


@pytest.fixture(autouse=True)
def nothing_left_on_any_host():
    yield
    alive = wait_until_gone(cell_processes(), timeout=15)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"


def notebook_node(kernel: Kernel) -> str:
    status = kernel.execute("%taas status").stream()
    return re.search(r"\(node (\w+)\): .*\(this notebook\)", status).group(1)


ACROSS_HOSTS = """\
#pragma taas --gpus 4 --output all
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
print("env", *(f"{k}={os.environ[k]}" for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")), flush=True)
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


def test_status_shows_the_cluster(attached):
    status = attached.execute("%taas status").stream()
    assert "3 node(s), 4/4 GPU free" in status
    assert status.count("2/2 GPU") == 2 and "0/0 GPU, 2/2 CPU free" in status
    assert "(this notebook)" in status


def test_four_ranks_across_two_hosts(attached, tmp_path):
    go_on = tmp_path / "go-on"
    msg_id, started = attached.submit(ACROSS_HOSTS.replace("GO_ON", repr(str(go_on))))
    try:  # live: rank 0 waits until its line has come, however long this machine takes to bring it
        before = attached.wait_for_stream(msg_id, "[rank 0] streamed before the end", timeout=120)
    finally:
        go_on.touch()
    ran = attached.collect(msg_id, started)
    assert ran.reply["status"] == "ok", ran.error_text()
    out = "".join(m.content["text"] for m in before if m.type == "stream" and m.content["name"] == "stdout")
    out += ran.stream("stdout")
    layout = re.search(r"cluster: ranks 0-1 on (.+?) \(node (\w+)\), ranks 2-3 on (.+?) \(node (\w+)\)", out)
    assert layout, out
    assert layout.group(2) == notebook_node(attached)  # rank 0 on the notebook's own host
    assert layout.group(2) != layout.group(4)
    for rank, local, group in ((0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)):
        assert f"[rank {rank}] env RANK={rank} LOCAL_RANK={local} LOCAL_WORLD_SIZE=2 GROUP_RANK={group} MASTER_ADDR={layout.group(1)}" in out
    assert ran.result["text/plain"] == "10.0"  # the all-reduce of 1+2+3+4 across both hosts
    assert attached.execute("print(total)").stream("stdout").strip() == "10.0"


def test_per_host_caps_the_ranks_on_each_host(attached):
    ran = attached.execute(
        "#pragma taas --gpus 2 --per-host 1 --output all\n"
        "import os\nprint('group', os.environ['GROUP_RANK'], os.environ['LOCAL_WORLD_SIZE'], flush=True)",
        timeout=120,
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    out = ran.stream("stdout")
    assert "[rank 0] group 0 1" in out and "[rank 1] group 1 1" in out


def test_a_rank_failing_on_the_second_host_names_rank_and_host(attached):
    msg_id, started = attached.submit(
        "#pragma taas --gpus 4\nimport os, time\n"
        "if os.environ['RANK'] == '3':\n    raise ValueError('bad shard')\ntime.sleep(60)"
    )
    ran = attached.collect(msg_id, started, timeout=120)
    assert ran.reply["status"] == "error"
    header = re.search(r"ranks 2-3 on (.+? \(node \w+\))", ran.stream("stdout")).group(1)
    text = ran.error_text()
    assert f"rank 3 on {header} raised ValueError: bad shard" in text, text
    assert ran.reply_at < 60  # every rank on both hosts was stopped, not waited for


def test_infeasible_request_fails_at_once_and_launches_nothing(attached):
    started = time.monotonic()
    ran = attached.execute("#pragma taas --gpus 6\nprint('never')")
    assert ran.reply["status"] == "error"
    assert "--gpus 6 cannot be placed: the cluster has 4 GPU(s) in all" in ran.error_text()
    assert "never" not in ran.stream()
    assert time.monotonic() - started < 10


def test_gpus_auto_is_one_rank_per_gpu_of_the_cluster(attached):
    ran = attached.execute("#pragma taas --gpus auto\nimport os\nint(os.environ['WORLD_SIZE'])", timeout=120)
    assert ran.reply["status"] == "ok", ran.error_text()
    assert ran.stream("stdout").startswith("taas: 4 rank(s) (--gpus auto: one per GPU of the cluster)"), ran.stream()
    assert ran.result["text/plain"] == "4"


def test_device_cpu_with_a_cluster_is_one_line_and_launches_nothing(attached):
    ran = attached.execute("#pragma taas --gpus 2 --device cpu\nprint('never')")
    assert ran.reply["status"] == "error"
    assert ran.stream("stderr").startswith("UsageError: taas: --device cpu runs the ranks on this host's CPU, "
                                           "but a cluster is attached"), ran.stream()
    assert len(ran.stream("stderr").splitlines()) == 1 and "never" not in ran.stream()


def test_interrupt_stops_ranks_on_every_host(attached, tmp_path):
    """Each host's agent interrupts its ranks (one SIGINT: every cell's ``finally`` has its time), then they stop."""
    msg_id, started = attached.submit(
        "#pragma taas --gpus 4 --output all\nimport os, time\ntry:\n    print('sleeping', flush=True)\n    time.sleep(120)\nfinally:\n"
        "    try:\n        time.sleep(0.5)\n        said = 'finally ran'\n    except KeyboardInterrupt:\n"
        "        said = 'finally cut short'\n"
        f"    open(os.path.join({str(tmp_path)!r}, 'rank' + os.environ['RANK']), 'w').write(said)\n"
    )
    attached.wait_for_stream(msg_id, tuple(f"[rank {rank}] sleeping" for rank in range(4)), timeout=120)  # each in its try
    attached.manager.interrupt_kernel()
    ran = attached.collect(msg_id, started, timeout=60)
    assert ran.reply["status"] == "error" and ran.error["ename"] == "KeyboardInterrupt"
    assert ran.reply_at < 60
    assert sorted((path.name, path.read_text()) for path in tmp_path.iterdir()) == [
        (f"rank{rank}", "finally ran") for rank in range(4)]
    again = attached.execute("#pragma taas --gpus 4\n__import__('os').environ['WORLD_SIZE']", timeout=120)
    assert again.result["text/plain"] == "'4'"  # the GPUs were given back


def test_cluster_local_returns_to_local_processes(attached, ray_cluster):
    assert "local mode" in attached.execute("%taas cluster local").stream()
    ran = attached.execute("#pragma taas --gpus 2\n__import__('os').environ['MASTER_ADDR']")
    assert ran.result["text/plain"] == "'127.0.0.1'"
    ran = attached.execute(f"%taas cluster {ray_cluster.address}", timeout=120)
    assert ran.reply["status"] == "ok", ran.error_text()


def test_taas_cluster_attaches_at_load_and_an_unreachable_one_leaves_the_local_mode(ray_cluster):
    kernel = Kernel(env={"TAAS_CLUSTER": ray_cluster.address})
    try:
        assert "(this notebook)" in kernel.execute("%taas status").stream()
        started = time.monotonic()
        ran = kernel.execute("%taas cluster 127.0.0.1:9")  # nothing listens on the discard port
        assert ran.reply["status"] == "error" and "no Ray cluster answers at '127.0.0.1:9'" in ran.reply["evalue"]
        assert time.monotonic() - started < 10
    finally:
        kernel.shutdown()
    kernel = Kernel(env={"TAAS_CLUSTER": "127.0.0.1:9"})
    try:
        assert "cluster: none (local processes)" in kernel.execute("%taas status").stream()
        ran = kernel.execute("#pragma taas --gpus 1\n__import__('os').environ['MASTER_ADDR']")
        assert ran.result["text/plain"] == "'127.0.0.1'"
    finally:
        kernel.shutdown()


def test_kernel_death_leaves_nothing_on_any_host(ray_cluster):
    kernel = Kernel()
    try:
        assert kernel.execute(f"%taas cluster {ray_cluster.address}", timeout=120).reply["status"] == "ok"
        msg_id, _ = kernel.submit("#pragma taas --gpus 4\nimport time\nprint('up', flush=True)\ntime.sleep(300)")
        kernel.wait_for_stream(msg_id, "up", timeout=120)
        # ranks, not an agent whose (padded) title happens to mention the module it starts; looked at until
        # it holds for 10 s: a rank's watchdog, just forked, carries the rank's name and command line until it
        # renames itself (one CI run counted 5)
        deadline = time.monotonic() + 10
        while True:
            running = [line for line in map(_described, cell_processes()) if line and "taas-watchdog" not in line]
            if sum("-m taas_magic.rank" in line and "HostAgent" not in line for line in running) == 4:
                break
            assert time.monotonic() < deadline, running
            time.sleep(0.2)
        assert sum("HostAgent" in line for line in running) == 2, running  # one agent per host
        psutil.Process(kernel.pid).send_signal(signal.SIGKILL)
    finally:
        kernel.shutdown()
    alive = wait_until_gone(cell_processes(), timeout=60)
    assert not alive, f"left behind after the kernel died: {[(p.pid, p.cmdline()) for p in alive]}"


def test_timeout_names_the_ranks_still_running_on_each_host(attached):
    ran = attached.execute(
        # --timeout counts from the launch: ranks 1 and 2 end in a second or two, more on a loaded machine
        "#pragma taas --gpus 4 --timeout 10\nimport os, time\nif os.environ['RANK'] in ('0', '3'):\n    time.sleep(60)",
        timeout=120,
    )
    assert ran.error["ename"] == "RunTimeout", ran.error_text()
    assert "ranks still running: 0, 3. Every rank was stopped." in ran.error_text()


DATA_CELL = """\
#pragma taas --gpus 4 --cpus 2 --output all
import os
passes = [sorted(int(batch[0, 0]) for batch in loader) for _ in range(2)]
print("seen", os.environ["RANK"], passes, flush=True)
"""


def test_data_workers_run_on_the_cpu_host_and_elements_reach_every_host(attached):
    setup = attached.execute(
        "import taas, torch\n"
        "loader = torch.utils.data.DataLoader(torch.arange(42.0).repeat_interleave(3).reshape(42, 3), batch_size=1, shuffle=True)\n"
        "taas.register(loader)"
    )
    assert setup.reply["status"] == "ok", setup.error_text()
    try:
        ran = attached.execute(DATA_CELL, timeout=180)
    finally:
        attached.execute("taas.unregister(loader)")
    assert ran.reply["status"] == "ok", ran.error_text()
    out = ran.stream("stdout")
    cpu_node = re.search(r"\(node (\w+)\): 0/0 GPU", attached.execute("%taas status").stream()).group(1)
    assert re.search(rf"data workers 0-1 on .+ \(node {cpu_node}\)", out), out  # the CPU-only host
    passes = {int(rank): json.loads(lists) for rank, lists in re.findall(r"\[rank (\d)\] seen \d (.*)", out)}
    assert sorted(passes) == [0, 1, 2, 3], out
    for pass_no in range(2):  # 42 elements, 4 ranks: 10 each, 2 dropped; disjoint; replayed
        shares = [passes[rank][pass_no] for rank in range(4)]
        assert all(len(share) == 10 for share in shares)
        together = [x for share in shares for x in share]
        assert len(set(together)) == 40 and set(together) <= set(range(42))
    first = {x for rank in range(4) for x in passes[rank][0]}
    second = {x for rank in range(4) for x in passes[rank][1]}
    assert first == second  # the second pass replays the elements prepared in the first


def test_a_failing_data_worker_on_the_cpu_host_stops_the_run(attached):
    setup = attached.execute(
        "import taas, torch\n"
        "class Flaky:\n"
        "    def __len__(self): return 40\n"
        "    def __getitem__(self, i):\n"
        "        if i == 13: raise OSError('unreadable shard')\n"
        "        return i\n"
        "flaky = torch.utils.data.DataLoader(Flaky(), batch_size=None)\n"
        "taas.register(flaky)"
    )
    assert setup.reply["status"] == "ok", setup.error_text()
    try:
        ran = attached.execute("#pragma taas --gpus 4 --cpus 2\nfor x in flaky: pass", timeout=120)
    finally:
        attached.execute("taas.unregister(flaky)")
    assert ran.reply["status"] == "error" and ran.error["ename"] == "WorkerFailed"
    text = ran.error_text()
    assert "element 13" in text and "OSError: unreadable shard" in text, text
    assert re.search(r"data worker \d on .+ \(node \w+\)", text), text


RESTARTED = """\
#pragma taas --gpus 4 --restarts 1
import os, signal, torch.distributed as dist, taas
dist.init_process_group("gloo", init_method="env://")
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
state = taas.load_checkpoint() or {"step": 0}
if attempt == 0:
    taas.save_checkpoint({"step": 5})
dist.barrier()
if attempt == 0 and dist.get_rank() == 3:
    open(os.path.join(PIDS, "attempt0"), "w").write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)
if dist.get_rank() == 3:
    open(os.path.join(PIDS, "attempt1"), "w").write(str(os.getpid()))
dist.barrier()
resumed, seen_attempt = state["step"], attempt
dist.destroy_process_group()
"""


def test_a_rank_killed_on_the_second_host_is_restarted_there(attached, tmp_path):
    ran = attached.execute(f"%config TaasMagics.checkpoint_dir = {str(tmp_path / 'checkpoints')!r}\n"
                           f"PIDS = {str(tmp_path)!r}")
    assert ran.reply["status"] == "ok", ran.error_text()
    try:
        ran = attached.execute(RESTARTED, timeout=180)
        assert ran.reply["status"] == "ok", ran.error_text()
        host = re.search(r"ranks 2-3 on (.+? \(node \w+\))", ran.stream("stdout")).group(1)
        assert "taas: attempt 1 of 2 failed: rank 3 was killed by SIGKILL; restarting every rank" in ran.stream("stderr")
        assert attached.execute("resumed, seen_attempt").result["text/plain"] == "(5, 1)"
        first, second = (int((tmp_path / name).read_text()) for name in ("attempt0", "attempt1"))
        assert first != second and not psutil.pid_exists(first)
        assert host in ran.stream("stdout")
    finally:
        attached.execute("%config TaasMagics.checkpoint_dir = ''")


def test_a_search_runs_its_trials_side_by_side_on_the_clusters_hosts(attached):
    pytest.importorskip("optuna")
    cell = ("#pragma taas --gpus 2 --trials 4 --sampler random\n"
            "import os, time, taas, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "t = taas.trial()\n"
            "x = t.suggest_float('x', -1.0, 1.0)\n"
            "both = [None, None]\n"
            "dist.all_gather_object(both, (x, os.environ['MASTER_ADDR'], os.environ['MASTER_PORT']))\n"
            "assert both[0][0] == both[1][0], both\n"
            "time.sleep(1.0)\n"
            "taas.report(0, loss=x * x)\n"
            "cluster_search_x = x\n"
            "dist.destroy_process_group()\n")
    ran = attached.execute(cell, timeout=300)
    assert ran.reply["status"] == "ok", ran.error_text()
    assert "2 at a time (the cluster's 4 GPU(s))" in ran.stream(), ran.stream()
    rows = json.loads(attached.execute("import taas\nprint(taas.trials()[['value', 'state', 'log']].to_json(orient='records'))")
                      .stream())
    assert [row["state"] for row in rows] == ["complete"] * 4
    headers = [json.loads(Path(row["log"]).read_text().splitlines()[0])["text"] for row in rows]
    assert all("cluster: " in header for header in headers), headers  # each trial placed by the cluster
    best = min(row["value"] for row in rows)
    assert abs(float(attached.execute("cluster_search_x ** 2").result["text/plain"]) - best) < 1e-9


ACROSS_HOSTS_BREAK = """\
#pragma taas --gpus 4
import os, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
if dist.get_rank() == 3:
    breakpoint()
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
dist.destroy_process_group()
total.item()
"""


def test_a_breakpoint_on_the_second_host_prompts_in_the_cell(attached):
    """Rank 3, on the other host, stops: its prompt comes over the run's authenticated connection
    (its host's agent), the other ranks wait in their all-reduce, and ``c`` lets the run end."""
    session = debug(attached, ACROSS_HOSTS_BREAK, ["p dist.get_rank(), os.environ['LOCAL_RANK']", "c"])
    assert session.error is None, session.error
    assert session.prompts == ["(Pdb rank 3) "] * 2, session.prompts
    assert "(3, '1')" in session.text and re.search(r"> Cell In\[\d+\], line 6, in <module>", session.texts[0])
    assert session.execution.result["text/plain"] == "10.0"


def test_ranks_on_both_hosts_see_what_rank_0_wrote_after_a_barrier(attached, tmp_path):
    """writes/refresh.py on a cluster whose hosts see the repository: ranks 1-3 (two on the second host) look every
    path up first, rank 0 changes them, and after a barrier every rank sees rank 0's changes."""
    (tmp_path / ".git").mkdir()
    ran = attached.execute(f"%taas config repo {tmp_path}\nimport os\nos.chdir({str(tmp_path)!r})\n" + CHANGES + "seed()")
    assert ran.reply["status"] == "ok", ran.error_text()
    try:
        every_rank_sees_rank_0s_writes(attached)
    finally:
        attached.execute(f"%taas config repo {os.getcwd()}\nos.chdir({os.getcwd()!r})")


def test_the_hang_line_names_where_ranks_on_both_hosts_are_while_they_wait(attached):
    the_hang_line_is_said_once_and_the_cell_completes(attached)


def test_a_profiled_cell_on_two_hosts_merges_both_ranks_on_measured_clocks(attached):
    two_hosts_merge_on_measured_clocks(attached)


def test_kept_ranks_on_two_hosts_are_profiled_cell_after_cell(attached):
    kept_ranks_on_two_hosts_are_profiled(attached)


def test_the_debugger_panel_stops_the_ranks_on_two_hosts_and_shows_each_ones_variables(attached):
    ranks_on_two_hosts_stop_in_the_panel(attached)


def test_kept_ranks_stay_on_the_cluster_across_cells_until_released(attached):
    keep = "#pragma taas --gpus 4 --keep --output all\n"
    first = attached.execute(keep + "import os, torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                             "mine = 10 * dist.get_rank()\nprint('pid', os.getpid())\n")
    assert first.reply["status"] == "ok", first.error_text()
    assert "--keep: new ranks, kept after this cell" in first.stream()
    pids = dict(re.findall(r"\[rank (\d)\] pid (\d+)", first.stream()))
    assert len(pids) == 4
    second = attached.execute(keep + "t = torch.ones(1)\ndist.all_reduce(t)\nprint('pid', os.getpid(), 'mine', mine, 'sum', t.item())\n")
    assert second.reply["status"] == "ok", second.error_text()
    assert "--keep: cell 2 on the kept ranks" in second.stream()
    for rank, pid in pids.items():
        assert f"[rank {rank}] pid {pid} mine {10 * int(rank)} sum 4.0" in second.stream(), second.stream()
    a_failed_collective_costs_the_cell_not_the_kept_ranks(attached, keep, pids)
    a_killed_rank_is_replaced_and_the_others_keep_their_state(attached, keep, pids)
    released = attached.execute("%taas release")
    assert "released the kept ranks (4 rank(s) on auto, Ray at" in released.stream(), released.stream()
    # last in the file: Ray's free counts lag a released placement group, and test_status_shows_the_cluster
    # asserts every GPU free at once (tests/ray/test_away.py waits for it)

