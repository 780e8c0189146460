"""--restarts K over a real kernel: a lost rank is restarted and the run resumes from rank 0's
checkpoint; a deterministic error is not retried for ever; --restarts 0 is unchanged; the data
workers' cache serves the restarted ranks; and what the ranks started is gone after the cell."""

import os
import time

import psutil
import pytest

from tests.kernel_client import wait_until_gone


@pytest.fixture
def checkpoints(kernel, tmp_path):
    """The shared kernel writes this test's checkpoints under tmp_path, and forgets it afterwards."""
    folder = tmp_path / "checkpoints"
    ran = kernel.execute(f"%config TaasMagics.checkpoint_dir = {str(folder)!r}")
    assert ran.reply["status"] == "ok", ran.error_text()
    yield folder
    kernel.execute("%config TaasMagics.checkpoint_dir = ''")


RESUMING = """\
#pragma taas --device cpu --gpus 2 --restarts 2
import os, signal, torch, torch.distributed as dist, taas
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
state = taas.load_checkpoint() or {{"step": 0, "w": torch.zeros(3)}}
resumed_from = state["step"]
open({pids!r} + f"/rank{{rank}}-attempt{{attempt}}", "w").write(str(os.getpid()))
for step in range(resumed_from, 6):
    t = torch.ones(3)
    dist.all_reduce(t)
    state["w"] += t
    state["step"] = step + 1
    taas.save_checkpoint(state)
    if attempt == 0 and rank == 1 and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
print(f"rank {{rank}} attempt {{attempt}} resumed from step {{resumed_from}}", flush=True)
max_restarts = os.environ["TORCHELASTIC_MAX_RESTARTS"]
shipped_sum = float(shipped.sum())  # a captured 8 MB tensor: its shared file serves every attempt
big = torch.full((3_000_000,), float(attempt))  # 12 MB back through rank 0's results file
dist.destroy_process_group()
"""


def test_a_killed_rank_is_restarted_and_the_run_resumes_from_rank_0s_checkpoint(kernel, checkpoints, tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    kernel.execute("import torch\nshipped = torch.ones(2_000_000)")
    ran = kernel.execute(RESUMING.format(pids=str(pids)))
    assert ran.reply["status"] == "ok", ran.error_text()
    out, err = ran.stream("stdout"), ran.stream("stderr")
    assert "taas: attempt 1 of 3 failed: rank 1 was killed by SIGKILL; restarting every rank (attempt 2 of 3)" in err
    assert "attempt 2 of 3 failed" not in err
    assert "rank 0 attempt 1 resumed from step" in out  # output goes on in the same cell
    # rank 0 saved step 2's state (unless it was stopped mid-save: then step 1's, whole); the run resumes there
    values = kernel.execute("(attempt, resumed_from, final := state['w'].tolist(), state['step'], max_restarts)")
    attempt, resumed_from, final, step, max_restarts = eval(values.result["text/plain"])  # noqa: S307 - our own repr
    assert attempt == 1 and resumed_from in (2, 3) and step == 6 and max_restarts == "2"
    assert final == [12.0, 12.0, 12.0]  # every step counted once, from the checkpoint on
    # rank 0's names come from the attempt that succeeded, the large ones too
    assert kernel.execute("(shipped_sum, float(big.sum()), big.numel())").result["text/plain"] == (
        "(2000000.0, 3000000.0, 3000000)")
    # the restarted rank 1 is a new process, and the one that was killed is gone
    first, second = (int((pids / f"rank1-attempt{n}").read_text()) for n in (0, 1))
    assert first != second and not psutil.pid_exists(first)
    # the notebook reads the last run's newest checkpoint after the cell; the run kept two, whole
    loaded = kernel.execute("import taas\n(taas.load_checkpoint()['step'], taas.checkpoint_path())")
    step, path = eval(loaded.result["text/plain"])  # noqa: S307 - our own repr
    assert step == 6 and os.path.basename(path).startswith("checkpoint-") and str(checkpoints) in path
    run_folder = next(checkpoints.iterdir())
    kept = sorted(name for name in os.listdir(run_folder) if name.endswith(".pt"))
    assert len(kept) == 2 and not [name for name in os.listdir(run_folder) if ".tmp-" in name]
    assert oct(os.stat(run_folder).st_mode & 0o777) == "0o700"
    assert oct(os.stat(run_folder / kept[-1]).st_mode & 0o777) == "0o600"


REPEATING = """\
#pragma taas --device cpu --gpus 2 --restarts 3
import os
if os.environ["RANK"] == "1":
    raise ValueError(f"bad batch in attempt {os.environ['TORCHELASTIC_RESTART_COUNT']}")
import time; time.sleep(30)
"""


def test_the_same_exception_twice_is_not_restarted_again(kernel):
    started = time.monotonic()
    ran = kernel.execute(REPEATING)
    assert ran.reply["status"] == "error"
    assert ran.error["ename"] == "RankFailed", ran.error_text()
    text, err = ran.error_text(), ran.stream("stderr")
    assert "attempt 1 of 4 failed: rank 1 raised ValueError: bad batch in attempt 0; restarting" in err
    assert "attempt 2 of 4 failed" not in err  # the second identical error ends the cell
    assert "raised ValueError: bad batch in attempt 1" in text
    assert "the error repeated: the same ValueError at line 4 in attempts 1 and 2" in text
    assert time.monotonic() - started < 30  # never rank 0's sleep


def test_restarts_0_fails_at_once_and_every_rank_sees_torchrun_s_counters(kernel):
    ran = kernel.execute("#pragma taas --device cpu --gpus 2\nimport os\n"
                         "counters = (os.environ['TORCHELASTIC_RESTART_COUNT'], os.environ['TORCHELASTIC_MAX_RESTARTS'])")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert kernel.execute("counters").result["text/plain"] == "('0', '0')"
    ran = kernel.execute("#pragma taas --device cpu --gpus 2\nimport os, signal\n"
                         "if os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                         "import time; time.sleep(30)")
    assert ran.error["ename"] == "RankFailed", ran.error_text()
    assert "restarting" not in ran.stream("stderr") and "was killed by SIGKILL" in ran.error_text()


def test_a_malformed_restarts_is_a_one_line_usage_error(kernel):
    ran = kernel.execute("#pragma taas --device cpu --gpus 2 --restarts many\nx = 1")
    assert ran.error["ename"] == "PragmaError"  # IPython's UsageError, shown as one line
    assert "--restarts needs an integer, got 'many'" in ran.error_text()


LOGGED_LOADER = """\
import os, torch, taas
from torch.utils.data import DataLoader, Dataset

class Logged(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, index):
        with open({log!r}, "a") as log:
            log.write(f"{{index}}\\n")
        return torch.full((4,), float(index))

loader = taas.register(DataLoader(Logged(), batch_size=4))
"""

RESTART_WITH_LOADER = """\
#pragma taas --device cpu --gpus 2 --cpus 2 --restarts 1
import os, signal, torch, torch.distributed as dist
dist.init_process_group("gloo")
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
seen = []
for n, batch in enumerate(loader):
    seen += batch[:, 0].int().tolist()
    if attempt == 0 and dist.get_rank() == 1 and n == 3:
        os.kill(os.getpid(), signal.SIGKILL)
gathered = [None, None]
dist.all_gather_object(gathered, seen)
every = sorted(i for part in gathered for i in part)
dist.destroy_process_group()
"""


def test_restarted_ranks_are_served_from_the_cache_nothing_is_prepared_twice(kernel, tmp_path):
    log = tmp_path / "prepared.log"
    ran = kernel.execute(LOGGED_LOADER.format(log=str(log)))
    assert ran.reply["status"] == "ok", ran.error_text()
    try:
        ran = kernel.execute(RESTART_WITH_LOADER)
        assert ran.reply["status"] == "ok", ran.error_text()
        assert "restarting every rank (attempt 2 of 2)" in ran.stream("stderr")
        assert kernel.execute("every == list(range(64)), attempt").result["text/plain"] == "(True, 1)"
        prepared = [int(line) for line in log.read_text().split()]
        assert sorted(prepared) == list(range(64))  # each element prepared once, in both attempts together
    finally:
        kernel.execute("taas.unregister(loader)")


DAEMONS = """\
#pragma taas --device cpu --gpus 2
import os, subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(300)"]
pids = [subprocess.Popen(sleeper, start_new_session=True).pid,
        subprocess.Popen(sleeper, start_new_session=True, env={{}}).pid]  # left its session, and its environment
read, write = os.pipe()
if os.fork() == 0:  # a double fork: the daemon's parent exits, the daemon is nobody's child
    os.setsid()
    grandchild = os.fork()
    if grandchild == 0:
        time.sleep(300)
        os._exit(0)
    os.write(write, str(grandchild).encode())
    os._exit(0)
pids.append(int(os.read(read, 64)))
mine = {pids!r} + f"/{{os.environ['RANK']}}"
open(mine + ".part", "w").write(" ".join(map(str, pids)))
os.rename(mine + ".part", mine)
while not all(os.path.exists({pids!r} + f"/{{rank}}") for rank in (0, 1)):
    time.sleep(0.01)  # both ranks have their daemons before either one ends the run
{ending}
"""


@pytest.mark.parametrize("ending", ["done = True", "raise RuntimeError('the cell fails')"])
def test_daemonised_grandchildren_are_gone_after_the_cell(kernel, tmp_path, ending):
    ran = kernel.execute(DAEMONS.format(pids=str(tmp_path), ending=ending))
    assert ran.reply["status"] == ("ok" if ending == "done = True" else "error"), ran.error_text()
    pids = [int(pid) for rank in (0, 1) for pid in (tmp_path / str(rank)).read_text().split()]
    assert len(pids) == 6
    left = wait_until_gone([psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)], timeout=30)
    running = [process for process in left if process.status() != psutil.STATUS_ZOMBIE]
    assert not running, [(process.pid, process.cmdline()) for process in running]
