import signal
import subprocess
import sys
import threading
import time

import psutil

from taas_magic.procs import LADDER, stop_groups


def _state(pid: int) -> str:
    """What /proc says of a process: its state, its signals pending, blocked, ignored and caught, where it waits."""
    try:
        with open(f"/proc/{pid}/status") as status:
            lines = [line.strip() for line in status if line.startswith(("State", "SigQ", "SigPnd", "ShdPnd", "SigBlk",
                                                                          "SigIgn", "SigCgt", "Threads"))]
        with open(f"/proc/{pid}/wchan") as wchan:
            lines.append("wchan: " + wchan.read())
        return "; ".join(lines)
    except OSError as exc:
        return f"gone ({exc})"


def _start(code):
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_sigint_is_enough_for_a_cooperative_process():
    # Python's own SIGINT handler, set by the child itself: a process started from a shell's background job
    # inherits SIGINT ignored, and Python then keeps ignoring it (CI once ran the suite so: SIGINT did nothing).
    cooperative = ("import signal, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
                   "print('ready', flush=True)\ntime.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", cooperative],
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    seen: list[str] = []  # the child's state 30 s after SIGINT, if it is still there (once in 30 loaded runs it was)
    try:
        assert proc.stdout.readline() == "ready\n"  # Python's own SIGINT handler is in place now
        watcher = threading.Timer(30.0, lambda: seen.append(_state(proc.pid)))
        watcher.start()
        # The ladder's rungs, with a first grace no loaded machine outlasts: what is tested is that a cooperative
        # process needs nothing after SIGINT, not how fast this machine runs its exit (LADDER's 1.5 s is policy,
        # and a busy CI machine once took longer, so a SIGTERM met a process already leaving on SIGINT).
        report = stop_groups([proc], ladder=[(signal.SIGINT, 60.0), *LADDER[1:]])
        watcher.cancel()
    finally:
        proc.stdout.close()
    assert report.signals == ["SIGINT"] and not report.still_running, (report, proc.returncode, seen)
    assert proc.returncode == -signal.SIGINT


def test_ladder_escalates_to_kill_and_takes_the_group_down():
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal,time; signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(proc.stdout.readline()))
        started = time.monotonic()
        report = stop_groups([proc])
        assert report.signals == ["SIGINT", "SIGTERM", "SIGKILL"]
        # the ladder's own waits and no more (4.5 s at most; here 2.5 s and the kill): the slack is a loaded machine's
        assert time.monotonic() - started < sum(grace for _, grace in LADDER) + 10
        # the group's SIGKILL reached the child too; on a loaded machine it may take a moment to be scheduled and die
        _, alive = psutil.wait_procs([child], timeout=60)
        assert not alive or alive[0].status() == psutil.STATUS_ZOMBIE
    finally:
        proc.stdout.close()


def test_already_exited_processes_need_no_signal():
    proc = _start("pass")
    proc.wait()
    assert stop_groups([proc]).signals == []



SWEEPER = """
import builtins, os, time
from taas_magic.rank import lifeline

lifeline.adopt_orphans()  # a child subreaper, as every rank is
go_read, go_write = os.pipe()
read, write = os.pipe()
middle = os.fork()
if middle == 0:  # a double fork: the daemon's parent exits, the daemon is re-parented to us
    os.setsid()
    daemon = os.fork()
    if daemon == 0:
        os.closerange(0, 3)  # holds no pipe of the test's: a survivor fails the assertion, not a timeout
        time.sleep(60)
        os._exit(0)
    os.write(write, str(daemon).encode())
    os.read(go_read, 1)
    os._exit(0)
daemon = int(os.read(read, 32))
real_open, raced = builtins.open, []


def state(pid):
    try:
        with real_open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return b"gone"


def racing_open(path, *args, **kwargs):
    # The sweep listed the middle process and now reads its children: it exits right now,
    # so this read finds none and its daemon becomes our child after the pass listed ours.
    if path == f"/proc/{middle}/task/{middle}/children" and not raced:
        raced.append(True)
        os.write(go_write, b"x")
        while state(middle) not in (b"Z", b"gone"):
            time.sleep(0.001)
    return real_open(path, *args, **kwargs)


builtins.open = racing_open
lifeline.kill_descendants()
builtins.open = real_open
print(daemon, bool(raced), state(daemon).decode(), flush=True)
"""


def test_the_rank_sweep_finds_an_orphan_re_parented_while_it_looked():
    """A double fork's daemon is below its parent until the parent exits, then the subreaper's own
    child: a pass that listed the parent before it exited cannot see the daemon; the next pass must."""
    import subprocess
    import sys

    import psutil

    ran = subprocess.run([sys.executable, "-c", SWEEPER], capture_output=True, text=True, timeout=60, check=True)
    daemon, raced, state = ran.stdout.split()
    assert raced == "True"  # the middle process really exited in the middle of a pass
    try:
        survivor = psutil.Process(int(daemon))
        alive = survivor.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        alive = False
    if alive:
        survivor.kill()
    assert state in ("Z", "gone") and not alive, f"the daemon {daemon} was left ({state})"


def test_an_interrupt_before_the_stop_is_the_only_sigint_and_keeps_its_grace():
    """A cell's ``finally`` that takes a moment: interrupted once, it finishes within the ladder's first grace; a
    second SIGINT from the ladder would have cut it short (the launch contract's ``interrupt``, then ``stop``)."""
    from taas_magic.launch.local.processes import LocalChild, LocalProcessGroup

    slow_finally = ("import signal, sys, time\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
                    "try:\n    print('ready', flush=True)\n    time.sleep(60)\nfinally:\n    print('finally began', flush=True)\n"
                    "    try:\n        time.sleep(0.3)\n        print('finally done', flush=True)\n"
                    "    except KeyboardInterrupt:\n        print('finally cut short', flush=True)\n        sys.exit(3)\n")
    processes = [subprocess.Popen([sys.executable, "-c", slow_finally], start_new_session=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    group = LocalProcessGroup([LocalChild(index, process) for index, process in enumerate(processes)])
    try:
        assert [process.stdout.readline() for process in processes] == ["ready\n"] * 2
        group.interrupt([0])  # rank 0 only: rank 1 gets its SIGINT from the stop ladder
        assert processes[0].stdout.readline() == "finally began\n"  # a second SIGINT now would cut it short
        assert group.stop()[0] == "SIGINT"
        said = [process.stdout.read() for process in processes]
        assert said[0] == "finally done\n", said  # one SIGINT, and the grace to finish
        assert said[1].startswith("finally began\n"), said  # the ladder's SIGINT, for the rank not interrupted before
        assert processes[0].wait(timeout=5) == -2  # KeyboardInterrupt, unhandled: as SIGINT
    finally:
        group.close()
