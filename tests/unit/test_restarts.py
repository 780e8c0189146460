"""Restarts, checkpoints and the autopsy, piece by piece: which failures restart, an atomic
checkpoint under a kill, what faulthandler's text becomes, and the processes a run leaves."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from taas_magic.autopsy import stacks
from taas_magic.errors import Failure, PeerFailed, RankFailed, RunTimeout, WorkerFailed
from taas_magic.kernel.supervision.restarts import how, refusal, restart_line
from taas_magic.peers import RANK, WORKER, Peer
from taas_magic.procs import kill_tagged
from taas_magic.writes import checkpoints


def _raised(line: int, kind: str = "ValueError") -> PeerFailed:
    return PeerFailed(Peer(RANK, 1), "localhost", Failure(f"raised {kind}: x", "", (kind, "<taas In[3]>", line)))


def test_any_failure_restarts_until_k_is_spent():
    killed = PeerFailed(Peer(RANK, 1), "localhost", Failure("was killed by SIGKILL without reporting an error"))
    assert refusal(0, 2, killed, None) is None
    assert refusal(1, 2, RunTimeout(5, (0, 1)), killed) is None
    assert refusal(2, 2, killed, killed) == "all 2 restarts (--restarts 2) were used"
    assert refusal(0, 0, killed, None) == ""  # --restarts 0: fail as always, nothing to add


def test_the_same_exception_at_the_same_line_twice_is_not_retried():
    assert refusal(1, 5, _raised(4), _raised(4)).startswith("the error repeated: the same ValueError at line 4")
    assert refusal(1, 5, _raised(4), _raised(5)) is None  # another line: another failure
    assert refusal(1, 5, _raised(4, "KeyError"), _raised(4)) is None
    assert refusal(2, 5, _raised(4), RunTimeout(3, (0,))) is None  # not in a row


def test_a_data_workers_failure_is_not_restarted():
    assert "data worker" in refusal(0, 3, PeerFailed(Peer(WORKER, 0), "localhost", Failure("raised OSError")), None)


def test_the_restart_line_names_the_attempt_the_rank_and_how():
    killed = PeerFailed(Peer(RANK, 1), "localhost", Failure("was killed by SIGKILL without reporting an error"))
    assert restart_line(0, 3, killed) == ("taas: attempt 1 of 4 failed: rank 1 was killed by SIGKILL; "
                                          "restarting every rank (attempt 2 of 4)")
    assert how(RunTimeout(5, (0, 2))) == "--timeout 5s passed (ranks still running: 0, 2)"


SAVE_FOREVER = """
import sys, torch
from taas_magic.writes import checkpoints
folder = sys.argv[1]
checkpoints.save({"step": 1}, folder, keep=2)
print("saved", flush=True)
checkpoints.save({"step": 2, "big": torch.zeros(400 << 20, dtype=torch.uint8)}, folder, keep=2)
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_whole(tmp_path):
    folder = str(tmp_path / "run")
    saver = subprocess.Popen([sys.executable, "-c", SAVE_FOREVER, folder], stdout=subprocess.PIPE, text=True)
    assert saver.stdout.readline().strip() == "saved"
    deadline = time.monotonic() + 30
    while not [name for name in os.listdir(folder) if ".tmp-" in name]:  # the second save is under way
        assert time.monotonic() < deadline
        time.sleep(0.005)
    saver.send_signal(signal.SIGKILL)
    saver.wait()
    saver.stdout.close()
    assert os.path.basename(checkpoints.newest(folder)) == "checkpoint-000001.pt"
    assert checkpoints.load(folder, "cpu") == {"step": 1}
    checkpoints.save({"step": 3}, folder, keep=2)  # the next save clears what the killed one left
    assert sorted(os.listdir(folder)) == [".gitignore", "checkpoint-000001.pt", "checkpoint-000002.pt"]
    assert checkpoints.load(folder, "cpu") == {"step": 3}


def test_only_the_newest_are_kept_and_files_are_owner_only(tmp_path):
    folder = str(tmp_path / "run")
    for step in range(5):
        path = checkpoints.save({"step": step}, folder, keep=2)
    assert sorted(name for name in os.listdir(folder) if name.endswith(".pt")) == [
        "checkpoint-000004.pt", "checkpoint-000005.pt"]
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(folder).st_mode & 0o777 == 0o700
    assert checkpoints.load(str(tmp_path / "none"), "cpu") is None


DUMP = """main 0x00007f0000000001
Thread 0x00007f0000000002 (most recent call first):
  File "/x/taas_magic/rank/lifeline.py", line 150 in flush
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f0000000001 (most recent call first):
  File "/v/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/v/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "<taas In[5]>", line 3 in <module>
  File "/x/taas_magic/rank/execute.py", line 45 in run_cell
"""
SOURCES = {"<taas In[5]>": ("Cell", ["import torch.distributed as dist", "t = 1", "dist.all_reduce(t)"]),
           "<ipython-input-2>": ("Cell In[2]", ["def wait():", "    time.sleep(9)"])}


def test_faulthandlers_text_becomes_threads_and_a_position():
    threads = stacks.parse(DUMP)
    assert threads[0].main and threads[0].frames[-1].function == "all_reduce"
    assert threads[1].ours and not threads[0].ours
    assert stacks.position(threads, SOURCES, "<taas In[5]>") == ("wait in all_reduce", "line 3")
    lines = stacks.describe(0, DUMP, SOURCES, "<taas In[5]>")
    assert lines[1] == "  Cell, line 3, in <module>\n    dist.all_reduce(t)"  # from the cell down
    assert "1 thread of taas's own" in lines[-1]


def test_an_earlier_cells_function_and_a_rank_that_did_not_answer():
    dump = ('main 0x1\nCurrent thread 0x0000000000000001 (most recent call first):\n'
            '  File "<ipython-input-2>", line 2 in wait\n  File "<taas In[5]>", line 2 in <module>\n')
    where = stacks.position(stacks.parse(dump), SOURCES, "<taas In[5]>")
    assert where == ("in time.sleep", "Cell In[2], line 2")
    assert stacks.summary({0: ("wait in all_reduce", "line 3"), 2: ("wait in all_reduce", "line 3"), 1: where,
                           3: stacks.position([], SOURCES, "")}) == (
        "ranks 0, 2 wait in all_reduce (line 3); rank 1 is at Cell In[2], line 2 in time.sleep; rank 3 did not answer")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="Linux: /proc says whose a process is")
def _environ(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            return environ.read()
    except OSError:
        return b""


def test_what_carries_a_runs_tag_is_ended_and_nothing_else():
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    tagged = subprocess.Popen(sleeper, env={**os.environ, "TAAS_OWNER": "1-abc-ranks"}, start_new_session=True)
    other = subprocess.Popen(sleeper, env={**os.environ, "TAAS_OWNER": "1-abd-ranks"}, start_new_session=True)
    try:
        # Popen returns once the child's exec closed its pipe, which is before the kernel has set up the new
        # program's environment: /proc shows it empty for a moment (seen once on a loaded machine)
        deadline = time.monotonic() + 10
        while (b"TAAS_OWNER=1-abc-ranks" not in _environ(tagged.pid) or b"TAAS_OWNER=1-abd-ranks" not in _environ(other.pid)) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kill_tagged("1-abc-") == [tagged.pid]
        assert tagged.wait(timeout=60) == -signal.SIGKILL
        assert psutil.Process(other.pid).is_running() and other.poll() is None
    finally:
        other.kill()
        other.wait()


def test_descendants_walk_a_processs_tree_and_never_below_init():
    from taas_magic.rank import lifeline

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in lifeline.descendants(os.getpid())
        assert lifeline.descendants(1) == [] and lifeline.descendants(0) == []
    finally:
        child.kill()
        child.wait()


def test_a_peer_failure_is_one_class_under_the_names_the_cell_shows():
    """PeerFailed(peer, ...) is a RankFailed or a WorkerFailed (what the README promises and a person
    may catch); it pickles as itself, and with_output builds a new one instead of changing it."""
    import pickle

    rank, worker = _raised(4), PeerFailed(Peer(WORKER, 2), "localhost", Failure("raised OSError"))
    assert type(rank) is RankFailed and type(worker) is WorkerFailed
    assert isinstance(rank, PeerFailed) and rank.rank == 1 and worker.worker == 2
    assert str(worker) == "data worker 2 on localhost raised OSError"
    again = pickle.loads(pickle.dumps(rank))
    assert type(again) is RankFailed and again.signature == rank.signature and again.peer == rank.peer
    shown = rank.with_output(("last",), ("a note",))
    assert shown is not rank and shown.last_lines == ("last",) and shown.notes == ("a note",) and rank.notes == ()
    assert shown._render_traceback_()[:2] == ["taas: rank 1 on localhost raised ValueError: x; every rank was stopped.",
                                              "a note"]
