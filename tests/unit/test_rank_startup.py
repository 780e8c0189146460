"""How every process the kernel starts begins and ends (taas_magic/rank/startup.py), in real child processes given
their handshake and placement lines on stdin as the kernel gives them: ``begin`` connects to a real PeerServer as the
placement's peer and proves the key (tests/unit/rankside.py), the key never in the environment, stdin then /dev/null
to the cell, the watchdog forked; with a write rule, writes under the repository land in the rank's layer; closing
the lifeline ends the rank and what it started, even a rank stuck in C code that holds the GIL; ``finish`` exits at
once with its code, output flushed, though an atexit hook and a non-daemon thread wait, and ends what the cell
started, even what left its session."""

from __future__ import annotations

import os

import pytest

from taas_magic import wire
from taas_magic.protocol import Answer, CellDone
from taas_magic.rank import startup  # noqa: F401 - the module under test, run by the children below
from tests.unit import rankside
from tests.unit.rankside import WAIT, KernelEnd

BEGIN = r'''
import os, subprocess, sys
from taas_magic.protocol import Answer, CellDone, Resumed
from taas_magic.rank import startup
channel = startup.begin()
key = bytes.fromhex(sys.argv[1])
with open(f"/proc/{os.getpid()}/environ", "rb") as environ:
    in_environment = key.hex().encode() in environ.read() or key in b"".join(os.environb.values())
children = []
for task in os.listdir(f"/proc/{os.getpid()}/task"):
    with open(f"/proc/{os.getpid()}/task/{task}/children") as listed:
        children += listed.read().split()
names = []
for child in children:
    with open(f"/proc/{child}/comm") as comm:
        names.append(comm.read().strip())
print(os.read(0, 10), subprocess.run(["cat"], capture_output=True).stdout, in_environment, names, flush=True)
channel.send(CellDone(False))
what = channel.expect(Answer).line
if what == "finish":
    import atexit, threading, time
    atexit.register(print, "atexit ran", flush=True)
    threading.Thread(target=time.sleep, args=(600,)).start()  # not a daemon: a plain exit would wait for it
    left = subprocess.Popen(["sleep", "600"], start_new_session=True)  # left the rank's session
    print(left.pid, startup.lifeline._watchdog, flush=True)
    print("unflushed", end="")
    startup.finish(7)
if what == "write":
    repository = sys.argv[2]
    with open(os.path.join(repository, "made.txt"), "w") as made:
        made.write("the rank's")
    with open(os.path.join(repository, "kept.txt")) as kept:
        print(open(os.path.join(repository, "made.txt")).read(), kept.read(), flush=True)
    startup.finish(0)
if what == "stuck":
    import re
    sleeper = subprocess.Popen(["sleep", "600"])
    print(sleeper.pid, flush=True)
    re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking: C code that never lets go of the GIL
'''


@pytest.fixture
def rank():
    """``rank(placement, *argv)``: a child begun with the kernel's lines on its stdin; (the kernel's end, the child)."""
    kernel = KernelEnd(ranks=3)
    started = []

    def begin(place: wire.Placement, *argv: str):
        script = BEGIN.replace("sys.argv[1]", repr(kernel.key.hex())).replace("sys.argv[2]", repr(argv[0] if argv else ""))
        child = rankside.start(script, kernel.handshake(), place.line())
        started.append(child)
        connected = kernel.accept()
        assert connected.receive() == CellDone(False)
        return connected, child

    yield begin
    for child in started:
        rankside.end(child)
    kernel.close()


def test_begin_connects_as_the_placements_peer_keeps_the_key_out_of_the_environment_and_stdin_from_the_cell(rank):
    connected, child = rank(wire.Placement(peer_id=2, who="rank 2"))
    assert connected.peer_id == 2
    connected.send(Answer("nothing more"))
    connected.close()
    code, out, err = rankside.finish(child)
    assert code == 0, err
    assert out == "b'' b'' False ['taas-watchdog']\n"  # stdin is /dev/null to the cell and what it starts


def test_finish_exits_at_once_with_its_code_and_output_and_ends_what_the_cell_started(rank):
    connected, child = rank(wire.Placement(peer_id=0, who="rank 0"))
    connected.send(Answer("finish"))
    code, out, err = rankside.finish(child)
    assert code == 7, err
    lines = out.split("\n")
    left, watchdog = (int(pid) for pid in lines[1].split())
    assert lines[2:] == ["unflushed"]  # flushed; the atexit hook never ran; the sleeping thread was not waited for
    assert rankside.gone(left) and rankside.gone(watchdog)
    connected.close()


def test_with_a_write_rule_writes_under_the_repository_land_in_the_ranks_layer(rank, tmp_path):
    repository, layer = tmp_path / "repository", tmp_path / "layer"
    repository.mkdir()
    layer.mkdir()
    (repository / "kept.txt").write_text("the repository's")
    connected, child = rank(wire.Placement(peer_id=1, who="rank 1", repository=str(repository), layer=str(layer),
                                           write_mode="python"), str(repository))
    connected.send(Answer("write"))
    code, out, err = rankside.finish(child)
    assert code == 0, err
    assert out.splitlines()[-1] == "the rank's the repository's"  # it reads back what it wrote, and the rest
    assert sorted(os.listdir(repository)) == ["kept.txt"]  # the repository never changed
    assert [name for _, _, names in os.walk(layer) for name in names if name == "made.txt"] == ["made.txt"]
    connected.close()


def test_closing_the_lifeline_ends_a_rank_stuck_in_c_code_and_what_it_started(rank):
    connected, child = rank(wire.Placement(peer_id=0, who="rank 0"))
    connected.send(Answer("stuck"))
    said = b""
    while said.count(b"\n") < 2:  # what begin left, then the pid of what the cell started
        chunk = os.read(child.stdout.fileno(), 4096)
        assert chunk, f"the rank ended before it was stuck: {said!r}"
        said += chunk
    sleeper = int(said.split(b"\n")[1])
    child.stdin.close()  # the kernel is gone
    assert child.wait(WAIT) == -9  # the watchdog's SIGKILL to the rank's group
    assert rankside.gone(sleeper)
    connected.close()


def test_sigint_raises_in_the_process_though_it_was_started_with_sigint_blocked_and_ignored():
    """As a Ray worker starts a host's ranks (SIGINT blocked, and ignored: Python keeps an inherited SIG_IGN):
    ``interruptible``, ``begin``'s first step, makes the kernel's interrupt a ``KeyboardInterrupt`` again."""
    import signal
    import subprocess
    import sys

    child = ("import os, signal, time\nfrom taas_magic.rank import startup\n"
             "before = (signal.getsignal(signal.SIGINT), signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))\n"
             "startup.interruptible()\nprint(before, flush=True)\n"
             "try:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(5)\n    print('not interrupted')\n"
             "except KeyboardInterrupt:\n    print('interrupted')\n")

    def blocked_and_ignored() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    ran = subprocess.run([sys.executable, "-c", child], preexec_fn=blocked_and_ignored, capture_output=True, text=True,
                         timeout=60)
    assert ran.stdout.splitlines() == ["(<Handlers.SIG_IGN: 1>, True)", "interrupted"], ran.stdout + ran.stderr
