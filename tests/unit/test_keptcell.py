"""Kept ranks as supervision sees them (kernel/supervision/keptcell.py's :class:`KeptGroup`) over real child
processes: why they ended (each dead rank in :func:`describe_exit`'s words, or why they were stopped), whether they
run (polled at most once per :data:`ALIVE_RECHECK_SECONDS`, on a clock the test moves), closing them (their
channels, then their group, once), and the line a cell says when their state is lost.

The ranks are ``python -c 'time.sleep(30)'`` processes in a small group exposing what :class:`ProcessGroup` gives
supervision here (``children`` with ``index`` and ``poll()``, and ``close()``); every one is killed and reaped when
its test ends."""

import signal
import subprocess
import sys
import types

import pytest

from taas_magic.kernel.supervision import keptcell
from taas_magic.kernel.supervision.keptcell import ALIVE_RECHECK_SECONDS, KeptGroup, lost_line
from taas_magic.peers import Peer

SLEEP = "import time; time.sleep(30)"


class _Rank:
    """One rank's process as a :class:`ChildProcess` is polled; each poll counted."""

    def __init__(self, index: int, process: subprocess.Popen) -> None:
        self.index, self.process, self.polls = index, process, 0

    def poll(self) -> int | None:
        self.polls += 1
        return self.process.poll()

    def end(self, how: signal.Signals) -> int:
        """Signal it and reap it: its exit code as ``poll`` will give it."""
        self.process.send_signal(how)
        return self.process.wait(timeout=30)


class _Group:
    """The ranks' process group: its children, and ``close`` (every one killed and reaped), logged."""

    def __init__(self, processes: list[subprocess.Popen], log: list) -> None:
        self.children = [_Rank(index, process) for index, process in enumerate(processes)]
        self.log = log

    def close(self) -> None:
        self.log.append("group closed")
        for rank in self.children:
            if rank.process.poll() is None:
                rank.process.kill()
            rank.process.wait(timeout=30)


class _Mux:
    """What ``greet`` and ``close`` use of the mux: each send recorded, its close logged."""

    def __init__(self, log: list) -> None:
        self.sent: list[tuple[Peer, bytes]] = []
        self.log = log

    def send(self, peer: Peer, body: bytes) -> bool:
        self.sent.append((peer, body))
        return True

    def close(self) -> None:
        self.log.append("mux closed")


@pytest.fixture
def start():
    """``start(n, codes={rank: code})``: a group of ``n`` real processes (each sleeping, or running its code) and the
    log its close writes to; every process started is killed and reaped after the test."""
    started: list[subprocess.Popen] = []

    def make(ranks: int, codes: dict[int, str] | None = None) -> tuple[_Group, list]:
        codes = codes or {}
        processes = [subprocess.Popen([sys.executable, "-c", codes.get(rank, SLEEP)]) for rank in range(ranks)]
        started.extend(processes)
        log: list = []
        return _Group(processes, log), log

    yield make
    for process in started:
        if process.poll() is None:
            process.kill()
    for process in started:
        process.wait(timeout=30)


@pytest.fixture
def clock(monkeypatch):
    """keptcell's monotonic clock, moved by the test: ``clock.now``."""
    fake = types.SimpleNamespace(now=1000.0)
    fake.monotonic = lambda: fake.now
    monkeypatch.setattr(keptcell, "time", fake)
    return fake


def test_ranks_never_started_have_not_ended_and_do_not_run():
    ranks = KeptGroup()
    assert ranks.ended_why() is None
    assert not ranks.running


def test_ranks_all_alive_have_not_ended(start):
    group, _ = start(3)
    ranks = KeptGroup(group=group)
    assert ranks.ended_why() is None
    assert [rank.polls for rank in group.children] == [1, 1, 1]


def test_a_rank_killed_is_named_with_its_signal(start):
    group, _ = start(3)
    assert group.children[1].end(signal.SIGKILL) == -signal.SIGKILL
    assert KeptGroup(group=group).ended_why() == "rank 1 was killed by SIGKILL"


def test_every_rank_that_ended_is_named_in_rank_order(start):
    group, _ = start(3, codes={0: "import sys; sys.exit(3)"})
    assert group.children[0].process.wait(timeout=30) == 3
    assert group.children[2].end(signal.SIGTERM) == -signal.SIGTERM
    assert KeptGroup(group=group).ended_why() == "rank 0 exited with code 3; rank 2 was killed by SIGTERM"


def test_why_they_were_stopped_comes_before_what_their_processes_say(start):
    group, _ = start(2)
    group.children[0].end(signal.SIGKILL)
    ranks = KeptGroup(group=group, lost="every rank was stopped")
    assert ranks.ended_why() == "every rank was stopped"
    assert [rank.polls for rank in group.children] == [0, 0]
    assert KeptGroup(lost="a rank did not stop in time").ended_why() == "a rank did not stop in time"


def test_ranks_that_were_lost_do_not_run_even_while_their_processes_do(start):
    group, _ = start(2)
    ranks = KeptGroup(group=group, lost="every rank was stopped")
    assert not ranks.running
    assert [rank.polls for rank in group.children] == [0, 0]


def test_running_polls_every_rank_at_most_once_per_recheck_window(start, clock):
    group, _ = start(2)
    ranks = KeptGroup(group=group)
    assert ranks.running and ranks.seen_alive_at == 1000.0
    assert [rank.polls for rank in group.children] == [1, 1]
    group.children[1].end(signal.SIGKILL)
    clock.now = 1000.0 + ALIVE_RECHECK_SECONDS * 0.8  # seen alive this recently: not polled again
    assert ranks.running
    assert [rank.polls for rank in group.children] == [1, 1] and ranks.seen_alive_at == 1000.0
    clock.now = 1000.0 + ALIVE_RECHECK_SECONDS * 1.2
    assert not ranks.running
    assert group.children[1].polls == 1 + 1 and ranks.seen_alive_at == 1000.0
    clock.now += ALIVE_RECHECK_SECONDS * 0.1  # a dead rank is not cached: polled again
    assert not ranks.running
    assert group.children[1].polls == 1 + 2
    assert ranks.ended_why() == "rank 1 was killed by SIGKILL"


def test_running_ranks_polled_again_after_the_window_are_seen_alive_then(start, clock):
    group, _ = start(2)
    ranks = KeptGroup(group=group)
    assert ranks.running
    clock.now = 1000.0 + ALIVE_RECHECK_SECONDS * 2
    assert ranks.running
    assert [rank.polls for rank in group.children] == [2, 2] and ranks.seen_alive_at == 1000.0 + ALIVE_RECHECK_SECONDS * 2


def test_close_closes_their_channels_then_their_group_once_and_they_no_longer_run(start, clock):
    group, log = start(2)
    mux = _Mux(log)
    ranks = KeptGroup(group=group, mux=mux)
    assert ranks.running and ranks.seen_alive_at == 1000.0
    ranks.close()
    assert log == ["mux closed", "group closed"]
    assert ranks.group is None and ranks.mux is None and ranks.seen_alive_at == float("-inf")
    assert [rank.process.poll() for rank in group.children] == [-signal.SIGKILL, -signal.SIGKILL]
    assert not ranks.running and ranks.ended_why() is None  # closed on purpose: nothing lost to say
    ranks.close()
    assert log == ["mux closed", "group closed"]


def test_close_of_ranks_never_started_does_nothing():
    ranks = KeptGroup(lost="every rank was stopped")
    ranks.close()
    assert ranks.group is None and ranks.mux is None and ranks.lost == "every rank was stopped"


def test_the_lost_line_says_why_and_that_the_next_kept_cell_starts_new_ranks():
    assert lost_line("a rank did not stop in time (in C code or a collective)") == (
        "taas: a rank did not stop in time (in C code or a collective): every rank was stopped and their state is "
        "lost; the next --keep cell starts new ranks")
