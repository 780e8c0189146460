"""The one supervision loop (kernel/supervision/attempts.py) with the keep-on-failure policy (keptcell.py's
:class:`Keeping`) over stand-ins that record each call, as test_attempts.py does for the restart policy: the real
verdict (verdict.py) decides from the events a stand-in supervisor plays as time passes on a clock the test moves,
the real relay shows the cell's lines, and kept ranks are a :class:`KeptGroup` whose processes and selector record
what they are sent and whether they are closed.

What a person sees of these is tested through a real kernel in tests/kernel/test_keep.py; here each rule stands
alone: which frames go to which rank, when the ranks are interrupted, what the cell says, and when their state is
kept or lost."""

import types

import pytest

from taas_magic import protocol, wire
from taas_magic.errors import RankFailed, RunTimeout
from taas_magic.kernel.supervision import attempts as attempt_loop
from taas_magic.kernel.supervision import keptcell
from taas_magic.kernel.supervision.keptcell import FAILURE_INTERRUPT_SECONDS, KEEP_WAIT_SECONDS, KEPT_LINE, Keeping, KeptGroup
from taas_magic.kernel.supervision.mux import FrameArrived, PeerExited
from taas_magic.kernel.supervision.server import PeerServer
from taas_magic.kernel.supervision.verdict import TimedOut, Verdict
from taas_magic.output.relay import OutputRelay
from taas_magic.peers import RANK, WORKER, Peer, PeerIds
from taas_magic.protocol import CellDone, RankError
from tests.unit.recording import WrittenText

RANKS = 3
DONE = "the outcome"
RUN = "run00000001"
INTERRUPT = protocol.encode(protocol.Interrupt(RUN))  # this cell's run, named


def _abandoned(log: list) -> list[int]:
    """The ranks sent ``Abandon`` for this cell's run (rank/betweencells.py: interrupted if in it, collectives ended)."""
    return [entry[1] for entry in log if entry[0] == "send" and isinstance(entry[2], bytes)
            and (frame := _decoded(entry[2])) is not None and isinstance(frame, protocol.Abandon) and frame.run == RUN]


def _decoded(body: bytes) -> object:
    try:
        return protocol.decode_body(body, protocol.ToPeer)
    except Exception:  # noqa: BLE001 - a test's stand-in body (b"spec"), not a frame
        return None


def _done(rank: int, raised: bool = False) -> FrameArrived:
    return FrameArrived(Peer(RANK, rank), CellDone(raised=raised))


def _raised(rank: int) -> FrameArrived:
    return FrameArrived(Peer(RANK, rank), RankError("raised ValueError: x", "Traceback ...", ("ValueError", "<cell>", 2)))


class _Process:
    def __init__(self, index: int) -> None:
        self.index, self.code = index, None

    def poll(self) -> int | None:
        return self.code


class _Group:
    """The kept ranks' processes: ``poll`` answers what the test sets; ``stop`` and ``close`` are logged."""

    def __init__(self, log: list) -> None:
        self.children = [_Process(index) for index in range(RANKS)]
        self.log = log

    def stop(self, graceful: bool = True) -> list[str]:
        self.log.append(("group stop", graceful))
        return []

    def close(self) -> None:
        self.log.append("group close")


class _Mux:
    """The kept ranks' selector: what is sent to each rank, and what else is asked of it, logged."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.channels = types.SimpleNamespace(ids=None, greeting=None)

    def send(self, peer: Peer, body: bytes) -> bool:
        self.log.append(("send", peer.index, body))
        return True

    def forget(self, which) -> None:
        assert which(Peer(WORKER, 0)) and not which(Peer(RANK, 0)), "only a kept cell's data workers are forgotten"
        self.log.append("forget workers")

    def close(self) -> None:
        self.log.append("mux close")


class _Supervised:
    """The supervisor as the loop and the policy drive it. ``watch`` plays the cell: a list of events for the
    verdict, then ``DONE`` (every rank ended it), a :class:`TimedOut`, or an exception; ``later`` maps a time on the
    clock to the events that arrive then (``pump`` moves the clock and plays them)."""

    def __init__(self, clock, log: list, cell: list, later: dict[float, list] | None = None) -> None:
        self.clock, self.log, self.cell, self.later = clock, log, cell, dict(later or {})
        self.stderr = WrittenText()
        self.relay = OutputRelay("rank0", PeerIds(RANKS), {"stdout": WrittenText(), "stderr": self.stderr})
        self.verdict = Verdict(RANKS, host=lambda peer: "host-a", clean_exit=Keeping.clean_exit)

    def show_start(self) -> None:
        self.log.append("show start")

    def attach(self, group, running) -> None:
        self.log.append("attach")
        running()

    def watch(self):
        self.log.append("watch")
        for play in self.cell:
            if isinstance(play, BaseException):
                raise play
            if play == DONE:
                return DONE
            self.verdict.saw(play)
        return None

    def pump(self, seconds: float) -> None:
        self.clock.now += seconds
        for at in sorted(at for at in self.later if at <= self.clock.now):
            for event in self.later.pop(at):
                self.verdict.saw(event)

    def explain_stop(self, autopsy: bool = True) -> None:
        self.log.append("explain stop")

    def last_words(self, notes: tuple[str, ...]):
        return self.verdict.failure.with_output(("its last line",), notes)

    def stop_everything(self, group, graceful: bool = True) -> None:
        self.log.append(("stop everything", graceful))

    def detach(self) -> None:
        raise AssertionError("kept ranks are never detached")

    @property
    def lines(self) -> list[str]:
        return self.stderr.text.splitlines()


@pytest.fixture
def clock(monkeypatch):
    """keptcell's monotonic clock, moved only by the stand-in's ``pump``."""
    fake = types.SimpleNamespace(now=1000.0)
    fake.monotonic = lambda: fake.now
    monkeypatch.setattr(keptcell, "time", fake)
    return fake


def _kept(log: list) -> KeptGroup:
    """Running kept ranks: their group and selector, as a cell before left them."""
    return KeptGroup(group=_Group(log), mux=_Mux(log))


def _parts():
    return types.SimpleNamespace(ids=PeerIds(RANKS), greeting=lambda peer: [b"spec", b"closure"],
                                 server=types.SimpleNamespace(readmit=lambda peers: None))


def _no_replacement(rank: int, joins: str | None) -> None:
    pytest.fail("no rank died: none is replaced")


def _run(policy: Keeping, supervised: _Supervised):
    """The loop as attempts.run_ranks drives it around the selector: its outcome or the exception it raised."""
    policy.mux(_parts())
    try:
        return attempt_loop.run(supervised, policy)
    except BaseException as exc:  # noqa: BLE001 - the test reads what the loop raised
        return exc
    finally:
        policy.close()


def test_a_cell_on_running_ranks_sends_each_rank_its_frames_then_shows_its_displays_and_keeps_them(clock):
    log: list = []
    ranks = _kept(log)
    policy = Keeping(ranks, start=lambda attempt: pytest.fail("running ranks are not started again"), run_id=RUN, replace=_no_replacement)
    outcome = _run(policy, _Supervised(clock, log, [_done(0), _done(1), _done(2), DONE]))
    assert outcome == DONE
    sends = [("send", rank, body) for rank in range(RANKS) for body in (b"spec", b"closure")]
    assert log == [*sends, "show start", "attach", "watch", "forget workers"]  # the cell's frames, then its displays
    assert ranks.mux.channels.ids == PeerIds(RANKS)  # this cell's peers
    assert policy.kept and ranks.group is not None and ranks.lost is None
    assert ranks.mux.channels.greeting(Peer(RANK, 0)) == []  # the selector outlives the cell: not its frames


def test_new_ranks_show_their_displays_before_they_start_and_are_kept_after_the_cell(clock):
    log: list = []
    ranks = KeptGroup()
    group = _Group(log)

    def start(attempt: int):
        log.append(("start", attempt))
        return group

    policy = Keeping(ranks, start, run_id=RUN, replace=_no_replacement)
    assert policy.fresh
    server = PeerServer(wire.new_key(), RANKS)  # the new ranks' selector listens on it
    readmit = server.readmit
    server.readmit = lambda peers: (log.append(("readmit", list(peers))), readmit(peers))
    parts = types.SimpleNamespace(ids=PeerIds(RANKS), greeting=lambda peer: [], server=server)
    try:
        mux = policy.mux(parts)
        try:
            assert attempt_loop.run(_Supervised(clock, log, [DONE]), policy) == DONE
        finally:
            policy.close()
        assert ranks.mux is mux and ranks.group is group and policy.kept
        assert log == [("readmit", [0, 1, 2]), ("readmit", []), "show start", ("start", 0), "attach", "watch"]
    finally:
        ranks.close()
        server.close()


def test_a_rank_that_raised_while_the_others_end_their_cell_is_the_cells_error_and_the_ranks_are_kept(clock):
    log: list = []
    ranks = _kept(log)
    supervised = _Supervised(clock, log, [_raised(1), _done(1, raised=True)],
                             later={clock.now + 0.1: [_done(0)], clock.now + 0.3: [_done(2)]})
    failure = _run(Keeping(ranks, start=None, run_id=RUN, replace=_no_replacement), supervised)
    assert isinstance(failure, RankFailed) and failure.rank == 1 and not failure.stopped  # no rank was stopped
    assert failure.notes == (KEPT_LINE,) and failure.last_lines == ("its last line",)
    assert supervised.lines == ["taas: rank 1 on host-a raised ValueError: x"]  # said at once, before the others' time
    assert not [entry for entry in log if entry[0] == "send" and entry[2] == INTERRUPT]
    assert _abandoned(log) == [0, 1, 2]  # every rank: their groups get a new communicator before the next cell
    assert log[-1] == "forget workers" and ranks.lost is None


def test_ranks_still_in_their_cell_after_the_wait_are_abandoned_and_kept_when_they_end_it(clock):
    log: list = []
    ranks = _kept(log)
    ended = [_done(0, raised=True), _done(2, raised=True)]  # each one's KeyboardInterrupt ends its cell
    supervised = _Supervised(clock, log, [_raised(1), _done(1, raised=True)],
                             later={clock.now + KEEP_WAIT_SECONDS + 0.5: ended})
    failure = _run(Keeping(ranks, start=None, run_id=RUN, replace=_no_replacement), supervised)
    assert isinstance(failure, RankFailed) and failure.notes == (KEPT_LINE,)
    assert _abandoned(log) == [0, 1, 2]  # ranks 0 and 2 are interrupted by it, in their cell; rank 1's is over
    assert ("stop everything", False) not in log and ranks.lost is None


def test_ranks_that_do_not_end_their_cell_even_interrupted_are_stopped_and_their_state_is_lost(clock):
    log: list = []
    ranks = _kept(log)
    failure = _run(Keeping(ranks, start=None, run_id=RUN, replace=_no_replacement), _Supervised(clock, log, [_raised(1), _done(1, raised=True)]))
    assert isinstance(failure, RankFailed) and failure.notes == (keptcell.lost_line(
        "not every rank ended its cell after the failure, even interrupted"),)
    assert clock.now >= 1000.0 + KEEP_WAIT_SECONDS + FAILURE_INTERRUPT_SECONDS
    assert log[-3:] == [("stop everything", False), "mux close", "group close"]  # TERM then KILL, then closed
    assert ranks.group is None and ranks.mux is None and ranks.lost == "every rank was stopped"


def test_a_rank_that_exits_even_with_0_fails_the_cell_and_costs_every_ranks_state(clock):
    log: list = []
    ranks = _kept(log)
    policy = Keeping(ranks, start=None, run_id=RUN, replace=_no_replacement)
    ranks.group.children[2].code = 0  # in the cell
    failure = _run(policy, _Supervised(clock, log, [PeerExited(Peer(RANK, 2), 0)]))
    assert isinstance(failure, RankFailed) and "exited in a kept cell (code 0) instead of ending it" in str(failure)
    assert ("stop everything", False) in log and ranks.lost == "every rank was stopped"


def test_a_timeout_abandons_the_ranks_at_once_and_keeps_them_if_they_end_their_cell(clock):
    log: list = []
    ranks = _kept(log)
    supervised = _Supervised(clock, log, [_done(0), TimedOut(5.0, (1, 2), ("rank 1 waits in all_reduce",))],
                             later={clock.now + 0.1: [_done(1, raised=True), _done(2, raised=True)]})
    failure = _run(Keeping(ranks, start=None, run_id=RUN, replace=_no_replacement), supervised)
    assert isinstance(failure, RunTimeout) and not failure.stopped and failure.notes[-1] == KEPT_LINE
    assert _abandoned(log) == [0, 1, 2]
    assert clock.now < 1000.0 + KEEP_WAIT_SECONDS  # no wait for the others before the interrupt


def test_an_interrupt_that_every_rank_obeys_keeps_them_with_no_autopsy(clock):
    log: list = []
    ranks = _kept(log)
    supervised = _Supervised(clock, log, [KeyboardInterrupt()],
                             later={clock.now + 0.2: [_done(rank, raised=True) for rank in range(RANKS)]})
    assert isinstance(_run(Keeping(ranks, start=None, run_id=RUN, replace=_no_replacement), supervised), KeyboardInterrupt)
    assert supervised.lines == [KEPT_LINE] and "explain stop" not in log and ranks.lost is None
    assert _abandoned(log) == [0, 1, 2]  # a collective an interrupt left half done is not used again


def test_an_interrupt_a_rank_does_not_obey_gets_the_autopsy_then_abandon_and_the_ranks_are_kept(clock):
    """A rank in a collective ends its cell only once it is abandoned: after the autopsy says where it is."""
    log: list = []
    ranks = _kept(log)
    supervised = _Supervised(clock, log, [KeyboardInterrupt()], later={
        clock.now + 0.2: [_done(0, raised=True)],
        clock.now + keptcell.INTERRUPT_WAIT_SECONDS + 0.3: [_done(1, raised=True), _done(2, raised=True)]})
    assert isinstance(_run(Keeping(ranks, start=None, run_id=RUN, replace=_no_replacement), supervised), KeyboardInterrupt)
    assert "explain stop" in log and log.index("explain stop") < [entry[0] if isinstance(entry, tuple) else entry
                                                                  for entry in log].index("send", log.index("explain stop"))
    assert supervised.lines == [KEPT_LINE] and _abandoned(log) == [0, 1, 2] and ranks.lost is None


def test_an_interrupt_a_rank_does_not_obey_even_abandoned_costs_every_ranks_state(clock):
    log: list = []
    ranks = _kept(log)
    supervised = _Supervised(clock, log, [KeyboardInterrupt()], later={clock.now + 0.2: [_done(0, raised=True)]})
    assert isinstance(_run(Keeping(ranks, start=None, run_id=RUN, replace=_no_replacement), supervised), KeyboardInterrupt)
    assert "explain stop" in log and supervised.lines == [keptcell.lost_line("a rank did not stop in time (in C code)")]
    assert ("stop everything", False) in log and ranks.group is None and ranks.lost == "every rank was stopped"
