import signal
import subprocess
import sys
import time

import psutil

from taas_magic.procs import stop_groups


def _start(code):
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_sigint_is_enough_for_a_cooperative_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time\nprint('ready', flush=True)\ntime.sleep(60)"],
                            start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"  # Python's own SIGINT handler is in place now
    report = stop_groups([proc])
    assert report.signals == ["SIGINT"]
    proc.stdout.close()
    assert proc.returncode == -signal.SIGINT and not report.still_running


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
    child_pid = int(proc.stdout.readline())
    started = time.monotonic()
    report = stop_groups([proc])
    assert report.signals == ["SIGINT", "SIGTERM", "SIGKILL"]
    assert time.monotonic() - started < 5
    assert not psutil.pid_exists(child_pid) or psutil.Process(child_pid).status() == psutil.STATUS_ZOMBIE
    proc.stdout.close()


def test_already_exited_processes_need_no_signal():
    proc = _start("pass")
    proc.wait()
    assert stop_groups([proc]).signals == []
