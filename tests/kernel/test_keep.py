"""Kept ranks (``--keep``) in a real kernel: the ranks, their globals and their gloo group live across
cells; names travel only when the notebook rebinds them; a failure or an interrupt keeps what it can and
says what it kept; release, another shape and the kernel's death leave nothing."""

import os
import re
import signal
import time

import psutil
import pytest

from tests.kernel_client import Execution, Kernel, assert_nothing_left, debug, wait_until_gone

KEEP = "#pragma taas --gpus 2 --device cpu --keep"


@pytest.fixture(scope="module")
def keeper():
    """A kernel of its own: kept ranks outlive cells, so no other test's kernel sees them."""
    kernel = Kernel()
    yield kernel
    kernel.shutdown()


@pytest.fixture()
def k(keeper):
    """Each test starts with no kept ranks and leaves none, nor anything else it started."""
    yield keeper
    ran = keeper.execute("%taas release")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert_nothing_left(keeper)


def ok(kernel: Kernel, code: str, timeout: float = 120):
    ran = kernel.execute(code, timeout=timeout)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    return ran


def pids_of(text: str) -> dict[int, int]:
    """``[rank k] pid P`` lines (--output all) -> {k: P}."""
    return {int(rank): int(pid) for rank, pid in re.findall(r"\[rank (\d)\] pid (\d+)", text)}


def kept_pids(kernel: Kernel) -> dict[int, int]:
    """A --keep cell that only says where each rank is: its ranks' pids."""
    return pids_of(ok(kernel, f"{KEEP} --output all\nimport os\nprint('pid', os.getpid())\n").stream())


def the_same_ranks_kept_what_the_cell_made_and_their_group_works(kernel: Kernel, first: Execution) -> None:
    """After a kept cell that bound ``made = "during"`` and was stopped in a collective: the next kept cell runs in
    the processes of ``first`` (a cell that printed each rank's pid), with ``made`` and a working default group."""
    again = ok(kernel, f"""{KEEP} --output all
total = torch.ones(1)
dist.all_reduce(total)
print("pid", os.getpid(), "made", made, "total", total.item())
""")
    assert pids_of(again.stream()) == pids_of(first.stream())
    assert again.stream().count("made during total 2.0") == 2, again.stream()


def test_globals_and_group_are_kept_over_three_cells_and_each_rank_keeps_its_own_values(k):
    first = ok(k, f"""{KEEP} --output all
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
group = dist.group.WORLD
w = torch.full((3,), float(dist.get_rank()))
print("pid", os.getpid())
dist.destroy_process_group()
""")
    assert "--keep: new ranks, kept after this cell" in first.stream()
    pids = pids_of(first.stream())
    assert len(pids) == 2
    ok(k, "assert w.tolist() == [0.0, 0.0, 0.0], w")  # rank 0's w came back to the notebook
    for cell in (2, 3):
        ran = ok(k, f"""{KEEP} --output all
dist.init_process_group("gloo")  # harmless: the kept group
assert dist.group.WORLD is group
t = torch.ones(1)
dist.all_reduce(t)
w += 1  # each rank its own w: the notebook's copy of rank 0's is not sent back
print("pid", os.getpid(), "w", w.tolist(), "sum", t.item())
dist.destroy_process_group()  # harmless too
""")
        text = ran.stream()
        assert f"--keep: cell {cell} on the kept ranks" in text
        assert pids_of(text) == pids, text
        assert f"[rank 1] pid {pids[1]} w {[float(cell)] * 3} sum 2.0" in text, text
        assert f"[rank 0] pid {pids[0]} w {[float(cell - 1)] * 3} sum 2.0" in text, text
    assert "kept ranks: 2 rank(s) on cpu, this host, 3 cell(s)" in ok(k, "%taas runs").stream()
    status = ok(k, "%taas status").stream()
    assert "kept ranks: 2 rank(s) on cpu, this host, 3 cell(s)" in status
    assert f"rank 1, pid {pids[1]} on localhost (cpu):" in status, status
    assert "MiB host" in status


def test_a_name_the_notebook_rebinds_reaches_every_rank_and_only_then(k):
    ok(k, "lr = 0.1")
    ok(k, f"""{KEEP} --output all
seen = lr
""")
    ran = ok(k, f"""{KEEP} --output all
print("lr", lr, "seen", seen)
""")
    assert "closure 0 B" in ran.stream()  # nothing travelled: the ranks had lr
    assert ran.stream().count("lr 0.1 seen 0.1") == 2
    ok(k, "lr = 0.5")
    ran = ok(k, f"""{KEEP} --output all
print("lr", lr)
""")
    assert ran.stream().count("lr 0.5") == 2, ran.stream()


def test_a_raise_on_every_rank_keeps_the_ranks_and_their_state(k):
    first = ok(k, f"""{KEEP} --output all
import os
state = [os.getpid()]
print("pid", os.getpid())
""")
    ran = k.execute(f"""{KEEP}
raise ValueError("bad cell")
""")
    error = ran.error_text()
    assert "raised ValueError: bad cell; every rank ended its cell" in error, error
    assert "the ranks are kept, with their globals and their process group" in error
    again = ok(k, f"""{KEEP} --output all
print("pid", os.getpid(), "state", state)
""")
    assert pids_of(again.stream()) == pids_of(first.stream())
    assert "cell 3 on the kept ranks" in again.stream()


def test_a_rank_waiting_in_a_collective_for_one_that_raised_leaves_it_within_2_s_and_both_keep_their_state(k):
    """Rank 1 raises; rank 0 waits in gloo's all_reduce for it (C code): rank 0 leaves it within 2 s of the raise,
    the same processes run the next cell within 3 s of the reply, with their globals and a working default group
    (its init_process_group harmless)."""
    first = ok(k, f"""{KEEP} --output all
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
made = f"made on {{dist.get_rank()}}"
print("pid", os.getpid())
""")
    ran = k.execute(f"""{KEEP}
if dist.get_rank() == 1:
    raised_at = time.time()
    raise RuntimeError("rank 1 gave up")
try:
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1, which never comes
finally:
    left_at = time.time()
""")
    error = ran.error_text()
    assert "rank 1 on localhost raised RuntimeError: rank 1 gave up" in error, error
    assert "the ranks are kept, with their globals and their process group" in error + ran.stream(), error
    assert ran.reply_at < 5.0, f"the error came {ran.reply_at:.1f} s after the cell started"
    replied = time.time()
    again = ok(k, f"""{KEEP} --output all
print("first line at", time.time(), flush=True)
dist.init_process_group("gloo")  # harmless: the kept group
total = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(total)
print("pid", os.getpid(), made, "total", total.item(), "times", globals().get("raised_at"), globals().get("left_at"))
""")
    text = again.stream()
    first_line = min(float(at) for at in re.findall(r"first line at ([\d.]+)", text))
    assert first_line - replied < 3.0, f"the next kept cell's first line came {first_line - replied:.2f} s after the reply"
    assert pids_of(text) == pids_of(first.stream())
    assert "made on 0 total 3.0" in text and "made on 1 total 3.0" in text, text
    raised_at = float(re.search(r"\[rank 1\].*times ([\d.]+) None", text).group(1))
    left_at = float(re.search(r"\[rank 0\].*times None ([\d.]+)", text).group(1))
    assert 0 <= left_at - raised_at < 2.0, f"rank 0 left the all_reduce {left_at - raised_at:.2f} s after rank 1 raised"


def test_an_interrupt_stops_the_cell_on_every_rank_and_keeps_its_state(k):
    first = ok(k, f"""{KEEP} --output all
import os, time
made = "before"
print("pid", os.getpid())
""")
    msg_id, started = k.submit(f"""{KEEP}
made = "during"
print("looping", flush=True)
while True:
    time.sleep(0.01)
""")
    k.wait_for_stream(msg_id, "looping")
    interrupted = time.monotonic()
    k.manager.interrupt_kernel()
    ran = k.collect(msg_id, started)
    assert time.monotonic() - interrupted < 3 + 2, "the interrupt took too long"  # 3 s, and the kernel's own turn
    assert ran.reply["status"] == "error" and ran.reply["ename"] == "KeyboardInterrupt"
    assert "the ranks are kept, with their globals" in ran.stream(), ran.stream()
    again = ok(k, f"""{KEEP} --output all
print("pid", os.getpid(), "made", made)
""")
    assert pids_of(again.stream()) == pids_of(first.stream())
    assert again.stream().count("made during") == 2


def test_an_interrupt_that_finds_a_rank_in_a_collective_shows_where_it_is_then_keeps_both(k):
    """Rank 1 loops in Python (it stops); rank 0 waits in gloo's all_reduce for it (C code: SIGINT cannot end it):
    the autopsy names where rank 0 is, then its collective is abandoned, and the ranks are kept with their state,
    the cell over within 3 s of the interrupt."""
    first = ok(k, f"""{KEEP} --output all
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
made = "before"
print("pid", os.getpid())
""")
    msg_id, started = k.submit(f"""{KEEP}
made = "during"
print("waiting", flush=True)
if dist.get_rank() == 1:
    while True:
        time.sleep(0.01)
dist.all_reduce(torch.ones(1))
""")
    k.wait_for_stream(msg_id, "waiting")
    time.sleep(0.5)  # rank 0 is in the all_reduce
    interrupted = time.monotonic()
    k.manager.interrupt_kernel()
    ran = k.collect(msg_id, started)
    took = time.monotonic() - interrupted
    text = ran.stream()
    assert ran.reply["status"] == "error" and ran.reply["ename"] == "KeyboardInterrupt"
    assert re.search(r"rank 0 waits in all_reduce", text), text
    assert "the ranks are kept, with their globals" in text, text
    assert took < 3.0 + 1.0, f"the interrupted cell ended {took:.1f} s after the interrupt"  # 3 s, and the client's turn
    the_same_ranks_kept_what_the_cell_made_and_their_group_works(k, first)


def test_no_group_timeout_fires_over_an_idle_pause_longer_than_it(k):
    ok(k, f"""{KEEP}
import datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
""")
    time.sleep(6)
    ran = ok(k, f"""{KEEP} --output all
t = torch.ones(1)
dist.all_reduce(t)
print("sum", t.item())
""")
    assert ran.stream().count("sum 2.0") == 2


def test_another_shape_ends_the_kept_ranks_in_one_line_and_starts_new_ones(k):
    first = kept_pids(k)
    ran = ok(k, """#pragma taas --gpus 3 --device cpu --keep --output all
import os
print("pid", os.getpid(), "old", "first" in globals())
""")
    text = ran.stream()
    assert "the kept ranks (2 rank(s) on cpu, this host) ended: this cell wants 3 rank(s) on cpu, this host" in text
    assert len(pids_of(text)) == 3 and set(pids_of(text).values()).isdisjoint(first.values())
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                   for pid in first.values())


def test_every_rank_dying_between_cells_means_new_ranks_and_the_cell_says_so(k):
    """One dead rank is replaced, the others keep theirs (tests/kernel/test_keep_replace.py); with none left there is
    nothing to keep."""
    first = kept_pids(k)
    for pid in first.values():
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    ran = ok(k, f"{KEEP} --output all\nimport os\nprint('pid', os.getpid())\n")
    assert "--keep: new ranks, kept after this cell (the last kept ranks ended: rank 0 was killed by SIGKILL; rank 1 " \
           "was killed by SIGKILL)" in ran.stream(), ran.stream()
    assert set(pids_of(ran.stream()).values()).isdisjoint(first.values())


def test_release_ends_the_ranks_and_frees_everything(k):
    ranks = [psutil.Process(pid) for pid in kept_pids(k).values()]
    released = ok(k, "%taas release").stream()
    assert "taas: released the kept ranks (2 rank(s) on cpu, this host, 1 cell(s))" in released
    assert not wait_until_gone(ranks, timeout=15)
    assert "no ranks are kept" in ok(k, "%taas release").stream()


def test_the_session_default_keeps_every_cell_and_the_options_that_cannot_keep_are_refused(k):
    ok(k, "%config TaasMagics.keep = True")
    try:
        first = ok(k, """#pragma taas --gpus 2 --device cpu --output all
import os
print("pid", os.getpid())
""")
        second = ok(k, """#pragma taas --gpus 2 --device cpu --output all
print("pid", os.getpid())
""")
        assert pids_of(first.stream()) == pids_of(second.stream())
        refused = k.execute("#pragma taas --gpus 2 --device cpu --restarts 1\npass")
        assert "taas: --keep with --restarts" in refused.error_text()
    finally:
        ok(k, "%config TaasMagics.keep = False")
    refused = k.execute(f"{KEEP} --trials 2\npass")
    assert "--keep with --trials" in refused.error_text()


def test_a_timeout_names_where_the_ranks_were_then_keeps_ranks_stopped_in_python_code(k):
    first = ok(k, f"""{KEEP} --output all
import os, time
counter = 0
print("pid", os.getpid())
""")
    ran = k.execute(f"""{KEEP} --timeout 3
while True:
    counter += 1
    time.sleep(0.01)
""")
    error = ran.error_text()
    assert "RunTimeout" in error and "the ranks are kept, with their globals" in error, error
    again = ok(k, f"""{KEEP} --output all
print("pid", os.getpid(), "counted", counter > 10)
""")
    assert pids_of(again.stream()) == pids_of(first.stream())
    assert again.stream().count("counted True") == 2


def test_a_timeout_that_finds_a_rank_in_a_collective_names_where_it_is_then_keeps_both(k):
    first = ok(k, f"""{KEEP} --output all
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
made = "before"
print("pid", os.getpid())
""")
    ran = k.execute(f"""{KEEP} --timeout 3
made = "during"
if dist.get_rank() == 1:
    while True:
        time.sleep(0.01)
dist.all_reduce(torch.ones(1))  # rank 0 waits here: the timeout's interrupt cannot end it, Abandon does
""")
    error = ran.error_text() + ran.stream()
    assert "RunTimeout" in error and "the ranks are kept, with their globals" in error, error
    assert re.search(r"rank 0 waits in all_reduce", error), error
    the_same_ranks_kept_what_the_cell_made_and_their_group_works(k, first)


def test_a_detached_kept_cell_holds_its_ranks_until_it_is_waited_for(k):
    ok(k, f"""{KEEP}
import time
ready = "no"
""")
    detached = ok(k, f"""{KEEP} --detach
time.sleep(2)
ready = "yes"
""")
    assert detached.reply["status"] == "ok"
    busy = k.execute(f"{KEEP}\nprint(ready)")
    found = re.search(r"the kept ranks are running run (\w+) now: %taas wait (\w+) first", busy.error_text())
    assert found and found.group(1) == found.group(2), busy.error_text()
    ok(k, f"%taas wait {found.group(1)}")
    ok(k, "assert ready == 'yes', ready")
    ran = ok(k, f"{KEEP} --output all\nprint('ready', ready)")
    assert ran.stream().count("ready yes") == 2


def test_a_name_deleted_on_the_ranks_is_freed_there(k):
    ok(k, f"""{KEEP}
import gc, weakref, torch
big = torch.zeros(1 << 20)
ref = weakref.ref(big)
""")
    ok(k, f"""{KEEP}
del big
""")
    ran = ok(k, f"""{KEEP} --output all
gc.collect()
print("freed", ref() is None)
""")
    assert ran.stream().count("freed True") == 2, ran.stream()


@pytest.mark.parametrize("end", ["the kernel's death", "unloading the extension"])
def test_the_kernels_death_or_unloading_the_extension_ends_kept_ranks_within_15_s(end):
    kernel = Kernel()
    try:
        ranks = [psutil.Process(pid) for pid in kept_pids(kernel).values()]
        if end == "unloading the extension":
            ok(kernel, "%unload_ext taas_magic")
        else:
            os.kill(kernel.pid, signal.SIGKILL)
        assert not wait_until_gone(ranks, timeout=15), f"kept ranks outlived {end}"
        if end == "unloading the extension":
            assert_nothing_left(kernel)
    finally:
        kernel.shutdown()


def test_a_registered_loader_is_served_to_every_kept_cell_by_its_own_data_workers(k):
    ok(k, """import torch, taas
from torch.utils.data import DataLoader, TensorDataset
kept_loader = taas.register(DataLoader(TensorDataset(torch.arange(32.0)), batch_size=4))
""")
    for cell in (1, 2):
        ran = ok(k, f"""{KEEP} --cpus 2 --output all
total = sum(float(batch[0].sum()) for batch in kept_loader)
print("total", total)
""")
        totals = [float(value) for value in re.findall(r"\] total (\S+)", ran.stream())]
        assert len(totals) == 2 and sum(totals) in (496.0, 992.0), ran.stream()  # a share each, or the whole each
        assert (f"cell {cell} on the kept ranks" if cell > 1 else "new ranks, kept after this cell") in ran.stream()
    ok(k, "taas.unregister(kept_loader)")


def test_a_breakpoint_in_a_kept_cell_prompts_and_the_ranks_stay(k):
    first = ok(k, f"""{KEEP} --output all
import os
secret = 40 + int(os.environ["RANK"])
print("pid", os.getpid())
""")
    session = debug(k, f"""{KEEP}
if int(os.environ["RANK"]) == 1:
    breakpoint()
    seen = secret
""", ["p secret", "c"])
    assert session.execution.reply["status"] == "ok", session.text
    assert session.prompts and "(Pdb rank 1)" in session.prompts[0], session.prompts
    assert "41" in session.texts[1], session.texts
    again = ok(k, f"""{KEEP} --output all
print("pid", os.getpid(), "seen" in globals())
""")
    assert pids_of(again.stream()) == pids_of(first.stream())
    assert f"[rank 1] pid {pids_of(first.stream())[1]} True" in again.stream(), again.stream()


def test_only_rank_0_writes_from_kept_ranks_and_each_diverted_write_is_said_once(k, tmp_path):
    repo = tmp_path / "repo"
    (repo / ".git").mkdir(parents=True)
    ok(k, f"%taas config repo {repo}\nimport os\nhere = os.getcwd()\nos.chdir({str(repo)!r})")
    try:
        first = ok(k, f"""{KEEP}
import os
with open(f"rank{{os.environ['RANK']}}.txt", "w") as f:
    f.write("first")
""")
        second = ok(k, f"""{KEEP}
with open(f"again{{os.environ['RANK']}}.txt", "w") as f:
    f.write("second")
""")
    finally:
        ok(k, f"%taas config repo {os.getcwd()}\nos.chdir(here)")
    assert sorted(path.name for path in repo.iterdir() if path.name != ".git") == ["again0.txt", "rank0.txt"]
    assert "rank 1 tried to change 1 path(s) in the repository" in first.stream(), first.stream()
    assert "rank 1 tried to change 2 path(s)" in second.stream(), second.stream()  # its layer, kept with it
    assert "diverted, kept in its layer until %taas release" in second.stream()


def test_a_raise_on_one_rank_while_the_other_is_in_python_code_interrupts_it_and_keeps_both(k):
    first = ok(k, f"""{KEEP} --output all
import os, time
print("pid", os.getpid())
""")
    ran = k.execute(f"""{KEEP}
if os.environ["RANK"] == "1":
    raise ValueError("only rank 1")
time.sleep(60)  # rank 0: plain Python, interrupted
""")
    error = ran.error_text()
    assert "rank 1 on localhost raised ValueError: only rank 1; every rank ended its cell" in error, error
    assert "the ranks are kept" in error and ran.reply_at < 10
    again = ok(k, f"""{KEEP} --output all
print("pid", os.getpid())
""")
    assert pids_of(again.stream()) == pids_of(first.stream())


def test_a_loop_that_leaves_a_registered_loader_early_does_not_feed_the_next_kept_cell(k):
    ok(k, """import torch, taas
from torch.utils.data import DataLoader, TensorDataset
early_loader = taas.register(DataLoader(TensorDataset(torch.arange(64.0)), batch_size=2))
""")
    ok(k, f"""{KEEP} --cpus 2
for batch in early_loader:
    break  # the elements sent ahead for this pass are left unread
""")
    ran = ok(k, f"""{KEEP} --cpus 2 --output all
print("batches", sum(1 for _ in early_loader))
""")
    counts = [int(value) for value in re.findall(r"\] batches (\d+)", ran.stream())]
    assert len(counts) == 2 and sum(counts) in (32, 64), ran.stream()  # whole passes, none of the last cell's
    ok(k, "taas.unregister(early_loader)")


def test_what_a_kept_cell_prints_last_shows_in_that_cell_and_not_the_next(k):
    first = ok(k, f"""{KEEP}
import sys
print("unfinished line", end="")
sys.stderr.write("unfinished error")
""")
    assert "unfinished line" in first.stream("stdout") and "unfinished error" in first.stream("stderr")
    second = ok(k, f"""{KEEP}
print("second")
""")
    assert "unfinished" not in second.stream() and "second" in second.stream()
    assert "\x01" not in first.stream() + second.stream()


def test_ddp_fsdp2_and_a_device_mesh_made_before_a_failed_cell_train_in_the_next_without_being_wrapped_again(k):
    """Rank 1 raises between DDP's forward and its backward, where rank 0 waits in the backward's all-reduce, then
    in a second cell before FSDP2's backward: the next cell trains the same DDP model, the FSDP2-sharded model with
    its optimizer, and uses the mesh, and the replicas agree."""
    ok(k, f"""{KEEP}
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
pair = dist.new_group([0, 1], backend="gloo")  # gloo named: abortable too
torch.manual_seed(0)
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
sharded = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
for layer in sharded:
    if isinstance(layer, torch.nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(sharded, mesh=mesh)
ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
sharded_opt = torch.optim.Adam(sharded.parameters(), lr=0.01)
def step(x):
    loss = ddp(x).pow(2).mean()
    loss.backward(); ddp_opt.step(); ddp_opt.zero_grad()
    loss = sharded(x).pow(2).mean()
    loss.backward(); sharded_opt.step(); sharded_opt.zero_grad()
    return loss.item()
step(torch.randn(4, 8))
""")
    failed = k.execute(f"""{KEEP}
for n in range(5):
    x = torch.randn(4, 8)
    if n == 3 and dist.get_rank() == 1:
        out = ddp(x)
        raise ValueError("a bad batch on rank 1")
    step(x)
""")
    assert "rank 1 on localhost raised ValueError: a bad batch on rank 1" in failed.error_text(), failed.error_text()
    assert "the ranks are kept" in failed.error_text() + failed.stream()
    failed = k.execute(f"""{KEEP}
x = torch.randn(4, 8)
ddp(x).sum().backward(); ddp_opt.zero_grad()
out = sharded(x).pow(2).mean()
if dist.get_rank() == 1:
    raise ValueError("rank 1 gave up before FSDP2's backward")
out.backward()  # rank 0 waits in the backward's reduce-scatter
""")
    assert "raised ValueError: rank 1 gave up before FSDP2's backward" in failed.error_text(), failed.error_text()
    ran = ok(k, f"""{KEEP}
losses = [step(torch.randn(4, 8) + dist.get_rank()) for _ in range(3)]
weights = torch.cat([p.detach().flatten() for p in ddp.parameters()])
gathered = [torch.zeros_like(weights) for _ in range(2)]
dist.all_gather(gathered, weights)
full = sharded[0].weight.full_tensor()
total = torch.ones(1)
dist.all_reduce(total, group=mesh.get_group())
dist.all_reduce(total, group=pair)
print("replicas agree", torch.equal(gathered[0], gathered[1]), "full", tuple(full.shape), "mesh", total.item(),
      "finite", all(l == l for l in losses), type(pair).__name__)
""")
    assert "replicas agree True full (16, 8) mesh 4.0 finite True AbortableGroup" in ran.stream(), ran.stream()


def _footprint(pid: int) -> tuple[int, int, int]:
    """A process's open files, threads and resident memory (bytes)."""
    process = psutil.Process(pid)
    return process.num_fds(), process.num_threads(), process.memory_info().rss


def test_ten_failed_cells_in_a_row_leak_no_files_threads_or_memory_in_the_kernel_or_the_ranks(k):
    """Each failure abandons a communicator (its sockets, its threads) and makes a new one: after the first two
    (what a first failure creates once: the reaper's thread), ten more leave every count where it was."""
    ranks = pids_of(ok(k, f"""{KEEP} --output all
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
print("pid", os.getpid())
""").stream())
    fail = f"""{KEEP}
if dist.get_rank() == 1:
    raise RuntimeError("rank 1 gave up")
model(torch.ones(8, 64)).sum().backward()  # rank 0 waits in the all-reduce
"""

    def settled() -> dict[str, tuple[int, int, int]]:
        ok(k, f"{KEEP}\ndist.all_reduce(torch.ones(1))\n")  # renewed, and the last generation reaped meanwhile
        time.sleep(0.5)
        return {"kernel": _footprint(k.pid), **{f"rank {rank}": _footprint(pid) for rank, pid in ranks.items()}}

    for _ in range(2):
        assert k.execute(fail).reply["status"] == "error"
    before = settled()
    for _ in range(10):
        ran = k.execute(fail)
        assert "the ranks are kept" in ran.error_text() + ran.stream(), ran.error_text()
    assert_nothing_grew(before, settled(), "ten failures")


def assert_nothing_grew(before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]],
                        what: str) -> None:
    """Each process's open files, threads and memory (:func:`_footprint`) after ``what`` as they were before."""
    for who, (files, threads, memory) in after.items():
        files_before, threads_before, memory_before = before[who]
        assert files <= files_before + 2, f"{who}: {files_before} -> {files} open files after {what}"
        assert threads <= threads_before + 1, f"{who}: {threads_before} -> {threads} threads after {what}"
        assert memory - memory_before < 40 << 20, f"{who}: {(memory - memory_before) >> 20} MiB more after {what}"
