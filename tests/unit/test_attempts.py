"""The one supervision loop (kernel/supervision/attempts.py) with the restart-on-failure policy (restarts.py's
:class:`Restarting`) over a stand-in :class:`Supervised` that records each call: the real rule (verdict.py,
restarts.py) decides, the real relay shows the restart line, and a process group that records ``stop`` and
``close`` stands where the ranks would be. The keep-on-failure policy's: test_keeping.py."""

import pytest

from taas_magic.errors import RankFailed, RunTimeout
from taas_magic.kernel.supervision import attempts as attempt_loop
from taas_magic.kernel.supervision.mux import FrameArrived, PeerExited
from taas_magic.kernel.supervision.restarts import Attempts, Restarting
from taas_magic.kernel.supervision.verdict import TimedOut, Verdict
from taas_magic.output.relay import OutputRelay
from taas_magic.peers import RANK, Peer, PeerIds
from taas_magic.protocol import RankError
from tests.unit.recording import WrittenText

RANK_1 = Peer(RANK, 1)
DONE = "the outcome"


class _Group:
    """An attempt's ranks, as the loop sees them: only ``interrupt``, ``stop`` and ``close``, recorded."""

    def __init__(self, attempt: int, log: list):
        self.attempt, self.log = attempt, log

    def interrupt(self, ranks) -> None:
        self.log.append(("interrupt", self.attempt, tuple(ranks)))

    def stop(self, graceful: bool = True) -> list[str]:
        self.log.append(("stop", self.attempt, graceful))
        return []

    def close(self) -> None:
        self.log.append(("close", self.attempt))


class _Supervised:
    """Each attempt plays one of ``plays``: ``DONE`` (it succeeds), an event for the verdict (it
    fails), or an exception ``watch`` raises. Every call goes into ``log``."""

    def __init__(self, plays: list, log: list):
        self.plays, self.log = list(plays), log
        self.stderr = WrittenText()
        self.relay = OutputRelay("rank0", PeerIds(2), {"stdout": WrittenText(), "stderr": self.stderr})
        self.verdict = Verdict(2, host=lambda peer: "host-a")

    def show_start(self) -> None:
        self.log.append(("show_start",))

    def explain_stop(self, autopsy: bool = True) -> None:
        self.log.append(("explain_stop", autopsy))

    def pump(self, seconds: float) -> None:
        raise AssertionError("the restart policy waits for nothing")

    def attach(self, group, running) -> None:
        self.log.append(("attach", group.attempt))
        running()  # every rank connected

    def watch(self):
        self.log.append(("watch",))
        play = self.plays.pop(0)
        if isinstance(play, BaseException):
            raise play
        if play == DONE:
            return DONE
        self.verdict.saw(play)
        return None

    def last_words(self, notes: tuple[str, ...]):
        self.log.append(("last_words", notes))
        return self.verdict.failure.with_output(("its last line",), notes)

    def stop_everything(self, group, graceful: bool = True) -> None:
        self.log.append(("stop_everything", group.attempt))

    def detach(self) -> None:
        self.log.append(("detach",))
        self.verdict.next_attempt()


def _run(plays: list, restarts: int):
    """The loop over ``plays``: its outcome (or the exception it raised), the calls, the cell's taas lines."""
    log: list = []
    supervised = _Supervised(plays, log)

    def start(attempt: int) -> _Group:
        log.append(("start", attempt))
        return _Group(attempt, log)

    attempts = Attempts(restarts, between=lambda attempt: log.append(("between", attempt)),
                        running=lambda may_restart: log.append(("running", may_restart)))
    try:
        outcome = attempt_loop.run(supervised, Restarting(start, attempts))
    except BaseException as exc:  # noqa: BLE001 - the test reads what the loop raised
        outcome = exc
    return outcome, log, "".join(supervised.stderr.written).splitlines()


def _exited(code: int = 1) -> PeerExited:
    return PeerExited(RANK_1, code)


def _raised(line: int) -> FrameArrived:
    return FrameArrived(RANK_1, RankError("raised ValueError: x", "", ("ValueError", "<taas In[3]>", line)))


def test_a_first_attempt_that_succeeds_is_the_outcome_and_its_group_is_closed():
    outcome, log, lines = _run([DONE], restarts=0)
    assert outcome == DONE
    assert log == [("show_start",), ("start", 0), ("attach", 0), ("running", False), ("watch",), ("detach",), ("close", 0)]
    assert lines == []


def test_a_failure_with_restarts_left_stops_the_group_at_once_and_starts_the_next_attempt():
    outcome, log, lines = _run([_exited(), DONE], restarts=1)
    assert outcome == DONE
    assert log == [
        ("show_start",), ("start", 0), ("attach", 0), ("running", True), ("watch",),
        ("last_words", ()), ("stop", 0, False), ("detach",), ("close", 0),  # no graceful stop: no finally runs
        ("between", 0),
        ("start", 1), ("attach", 1), ("running", False), ("watch",), ("detach",), ("close", 1),
    ]
    assert lines == ["taas: attempt 1 of 2 failed: rank 1 exited with code 1; restarting every rank (attempt 2 of 2)"]


def test_a_failure_with_no_restarts_stops_everything_and_raises_the_last_words():
    outcome, log, lines = _run([_exited(), DONE], restarts=0)
    assert isinstance(outcome, RankFailed) and outcome.rank == 1
    assert outcome.last_lines == ("its last line",) and outcome.notes == ()  # --restarts 0: nothing to add
    assert log == [("show_start",), ("start", 0), ("attach", 0), ("running", False), ("watch",),
                   ("last_words", ()), ("stop_everything", 0), ("detach",), ("close", 0)]
    assert lines == []


def test_the_last_restart_spent_is_said_under_the_error():
    outcome, log, lines = _run([_exited(), _exited(-9), DONE], restarts=1)
    assert isinstance(outcome, RankFailed) and str(outcome) == "rank 1 on host-a was killed by SIGKILL without reporting an error"
    used = "taas: all 1 restart (--restarts 1) were used"
    assert outcome.notes == (used,)
    assert log[-4:] == [("last_words", (used,)), ("stop_everything", 1), ("detach",), ("close", 1)]
    assert [entry for entry in log if entry[0] in ("start", "running")] == [
        ("start", 0), ("running", True), ("start", 1), ("running", False)]


def test_the_same_error_twice_in_a_row_is_refused_with_restarts_left():
    outcome, log, _ = _run([_raised(4), _raised(4), DONE], restarts=3)  # the loop hands the previous failure on
    assert isinstance(outcome, RankFailed)
    assert outcome.notes[0].startswith("taas: the error repeated: the same ValueError at line 4 in attempts 1 and 2")
    assert ("start", 2) not in log and log[-3:] == [("stop_everything", 1), ("detach",), ("close", 1)]


def test_a_timed_out_attempt_says_where_its_ranks_were_before_the_restart_line():
    where = ("rank 1 waits in all_reduce", "  at line 3")
    outcome, _, lines = _run([TimedOut(5.0, (1,), where), DONE], restarts=1)
    assert outcome == DONE
    assert lines == [*where, "taas: attempt 1 of 2 failed: --timeout 5s passed (ranks still running: 1); "
                             "restarting every rank (attempt 2 of 2)"]


def test_an_interrupt_is_never_retried_and_the_group_is_still_detached_and_closed():
    outcome, log, lines = _run([KeyboardInterrupt(), DONE], restarts=2)
    assert isinstance(outcome, KeyboardInterrupt)
    assert log == [("show_start",), ("start", 0), ("attach", 0), ("running", True), ("watch",), ("explain_stop", True),
                   ("interrupt", 0, (0, 1)), ("detach",), ("close", 0)]  # where the ranks were (the autopsy), then
    # SIGINT (the signal: a cell's own ranks), then the group's close: its stop ladder gives them their grace
    assert lines == []


def test_a_failure_while_stopping_everything_still_detaches_and_closes():
    class Failing(_Supervised):
        def stop_everything(self, group, graceful: bool = True) -> None:
            super().stop_everything(group)
            raise OSError("the stop failed")

    log: list = []
    supervised = Failing([TimedOut(1.0, (0, 1))], log)
    with pytest.raises(OSError, match="the stop failed"):
        attempt_loop.run(supervised, Restarting(lambda attempt: _Group(attempt, log), Attempts(0)))
    assert log[-3:] == [("stop_everything", 0), ("detach",), ("close", 0)]


def test_a_refused_timeout_is_raised_with_where_the_ranks_were():
    outcome, _, _ = _run([TimedOut(2.0, (0, 1), ("rank 0 at line 1",))], restarts=0)
    assert isinstance(outcome, RunTimeout) and outcome.running == (0, 1) and outcome.notes == ("rank 0 at line 1",)
