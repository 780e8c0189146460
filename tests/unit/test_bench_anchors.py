"""bench/launch.py survives an anchor: one that fails or hangs is a reason, and what it started is gone.

The tests name their own marker (``ipengine-hang``, ``ipengine-fail``): the bench's default markers
("torch", "ipykernel", ...) would reap any such process of this user that starts in the window, a
person's notebook kernel or another test run's ranks among them."""

import subprocess
import sys
import time

import psutil

from bench.anchors import run_with_deadline


def _start_orphaned_sleeper(tag: str) -> int:
    """A grandchild in its own session whose parent exits at once, as a daemonised engine would be."""
    code = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', "
            f"'ipengine-{tag}'], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def test_a_hanging_anchor_is_stopped_at_its_deadline_and_leaves_nothing():
    started: list[int] = []

    def hangs(cwd):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        started.extend([child.pid, _start_orphaned_sleeper("hang")])
        child.wait()  # until the deadline's stop kills it: reaped here, so no "still running" warning when collected
        time.sleep(300)  # and still hung

    began = time.monotonic()
    outcome = run_with_deadline("hangs", hangs, "/tmp", deadline=2, markers=("ipengine-hang",))
    assert outcome == "hung past its 2 s deadline (stopped)"
    assert time.monotonic() - began < 15
    assert len(started) == 2 and not [pid for pid in started if psutil.pid_exists(pid)
                                      and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def test_a_failing_anchor_is_a_reason_and_its_figures_otherwise():
    left = []

    def fails(cwd):
        left.append(_start_orphaned_sleeper("fail"))
        raise RuntimeError("stop_cluster_sync timed out\nmore lines")

    assert run_with_deadline("fails", fails, "/tmp", deadline=10, markers=("ipengine-fail",)) == \
        "failed: RuntimeError: stop_cluster_sync timed out"
    assert not psutil.pid_exists(left[0]) or psutil.Process(left[0]).status() == psutil.STATUS_ZOMBIE
    assert run_with_deadline("works", lambda cwd: (0.5, 1.5), "/tmp", deadline=10, markers=("ipengine-none",)) == (0.5, 1.5)
