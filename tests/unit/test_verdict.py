"""The supervisor's failure policy (kernel/supervision/verdict.py), fed events as the mux would make them:
no process is started, no socket opened, no clock read."""

from taas_magic.errors import RankFailed, RunTimeout, WorkerFailed
from taas_magic.kernel.supervision.mux import FrameArrived, FrameRefused, Output, PeerConnected, PeerExited
from taas_magic.kernel.supervision.restarts import refusal
from taas_magic.kernel.supervision.verdict import SETTLE_SECONDS, TimedOut, Verdict
from taas_magic.output.reports import Report
from taas_magic.peers import RANK, WORKER, Peer
from taas_magic.protocol import Done, RankError, WorkerFailure

RANK_0, RANK_1, WORKER_0 = Peer(RANK, 0), Peer(RANK, 1), Peer(WORKER, 0)
SIGKILL = -9


def _verdict(ranks: int = 2) -> Verdict:
    return Verdict(ranks, host=lambda peer: f"host-{peer.kind}-{peer.index}", loader=lambda feed: f"loader{feed}")


def _raised(peer: Peer, line: int = 4) -> FrameArrived:
    return FrameArrived(peer, RankError("raised ValueError: x", "Traceback ...", ("ValueError", "<taas In[3]>", line)))


def test_output_connections_and_reports_are_not_failures():
    verdict = _verdict()
    for event in (PeerConnected(RANK_0), Output(RANK_0, "stdout", b"hi"), FrameArrived(RANK_1, Report(0.0, [], None))):
        verdict.saw(event)
    assert verdict.failure is None and not verdict.ranks_exited()


def test_the_first_reported_error_is_the_root_cause_and_its_exit_adds_nothing():
    verdict = _verdict()
    verdict.saw(_raised(RANK_1))
    verdict.saw(FrameArrived(RANK_0, RankError("raised RuntimeError: peer gone", "")))  # its collective, later
    verdict.saw(PeerExited(RANK_1, 1))  # the rank that reported exits 1: not a second, silent failure
    failure = verdict.failure
    assert isinstance(failure, RankFailed) and failure.rank == 1 and failure.host == "host-rank-1"
    assert failure.summary == "raised ValueError: x" and failure.signature == ("ValueError", "<taas In[3]>", 4)
    assert verdict.cause == RANK_1 and not verdict.silent


def test_a_silent_death_is_the_cause_of_the_errors_its_peers_raise_whichever_came_first():
    verdict = _verdict()
    verdict.saw(FrameArrived(RANK_0, RankError("raised RuntimeError: Connection reset by peer", "")))
    assert not verdict.settled(0.0)  # a silent death may still claim it
    verdict.saw(PeerExited(RANK_1, SIGKILL))
    assert verdict.cause == RANK_1 and verdict.silent and verdict.settled(0.0)
    assert str(verdict.failure) == "rank 1 on host-rank-1 was killed by SIGKILL without reporting an error"
    verdict.saw(PeerExited(RANK_0, 1))  # the peer's own exit, after its report: the cause stays
    assert verdict.cause == RANK_1


def test_a_second_silent_death_does_not_replace_the_first():
    verdict = _verdict(3)
    verdict.saw(PeerExited(RANK_1, SIGKILL))
    verdict.saw(PeerExited(Peer(RANK, 2), SIGKILL))
    assert verdict.cause == RANK_1


def test_settling_ends_after_the_settle_time_or_when_every_rank_exited():
    verdict = _verdict()
    verdict.saw(_raised(RANK_0))
    assert not verdict.settled(SETTLE_SECONDS / 2) and verdict.settled(SETTLE_SECONDS)
    verdict.saw(PeerExited(RANK_0, 1))
    verdict.saw(PeerExited(RANK_1, 0))
    assert verdict.settled(0.0) and verdict.exit_codes == {0: 1, 1: 0} and verdict.running() == ()


def test_clean_exits_end_the_attempt_without_a_failure():
    verdict = _verdict()
    verdict.saw(PeerExited(RANK_1, 0))
    assert verdict.running() == (0,) and not verdict.ranks_exited()
    verdict.saw(PeerExited(RANK_0, 0))
    assert verdict.failure is None and verdict.ranks_exited()


def test_a_forged_frame_fails_the_peer_that_sent_it():
    verdict = _verdict()
    verdict.saw(FrameRefused(RANK_0, "sent a frame that failed authentication (frame MAC mismatch)"))
    assert str(verdict.failure) == "rank 0 on host-rank-0 sent a frame that failed authentication (frame MAC mismatch)"


def test_a_data_worker_fails_by_its_report_or_by_ending_before_it_is_done():
    reported = _verdict()
    reported.saw(FrameArrived(WORKER_0, WorkerFailure(0, "element 3 of pass 0", [("x.py", 1, "f", "boom()")],
                                                       "OSError: disk\n")))
    failure = reported.failure
    assert isinstance(failure, WorkerFailed) and failure.host == "host-worker-0"
    assert failure.summary == "raised OSError: disk while preparing element 3 of pass 0 of loader0"
    early = _verdict()
    early.saw(PeerExited(WORKER_0, 0))
    assert str(early.failure) == "data worker 0 on host-worker-0 exited before preparing its share of the elements"
    done = _verdict()
    done.saw(FrameArrived(WORKER_0, Done(0)))
    done.saw(PeerExited(WORKER_0, 0))
    assert done.failure is None


def test_the_timeout_names_the_running_ranks_and_carries_where_they_were():
    verdict = _verdict()
    verdict.saw(PeerExited(RANK_0, 0))
    verdict.saw(TimedOut(5.0, verdict.running(), ("ranks 1 wait in all_reduce (line 3)",)))
    failure = verdict.failure
    assert isinstance(failure, RunTimeout) and failure.running == (1,) and verdict.cause == RANK_1
    assert failure.notes == ("ranks 1 wait in all_reduce (line 3)",)


def test_what_to_retry_the_same_error_twice_is_not_and_workers_are_remembered_across_attempts():
    verdict = _verdict()
    verdict.saw(FrameArrived(WORKER_0, Done(0)))
    verdict.saw(_raised(RANK_1))
    assert refusal(0, 3, verdict.failure, None) is None  # restart
    first = verdict.failure
    verdict.next_attempt()
    assert verdict.failure is None and verdict.running() == (0, 1)
    verdict.saw(_raised(RANK_0))
    assert refusal(1, 3, verdict.failure, first).startswith("the error repeated: the same ValueError at line 4")
    verdict.saw(PeerExited(WORKER_0, 0))  # its Done came in the first attempt: a clean end
    assert verdict.cause == RANK_0


def test_the_error_the_cell_shows_is_built_anew_with_the_last_lines_and_notes():
    verdict = _verdict()
    verdict.saw(_raised(RANK_1))
    shown = verdict.failure.with_output(("last line",), ("taas: all 1 restart (--restarts 1) were used",))
    assert shown is not verdict.failure and verdict.failure.last_lines == () and verdict.failure.notes == ()
    assert shown.last_lines == ("last line",) and shown.notes == ("taas: all 1 restart (--restarts 1) were used",)
    assert "--- last 1 lines of output of rank 1 ---" in shown._render_traceback_()
