"""The run loop: start, feed, watch and always reap the ranks of one cell.

Runs in the kernel, on the run's own thread (kernel/runs/background.py), and installs no signal
handler: a stop (``%taas stop``, or an interrupt of the cell that waits for the run) is asked through
``stop_asked`` and raised here as ``KeyboardInterrupt``, and the ``finally`` of :func:`run_ranks`
stops every rank. It is three parts and the loop that wires them, as
torch's elastic agent keeps its process context, its restart loop and its log tailing apart:

- mux.py, the mechanism: one selector over the listener, the handshakes, every process's
  pipes, channel and exit (a pidfd per local process, so the run ends the moment its last
  rank does), read as typed events; no threads to race;
- verdict.py, the policy: which failure is the root cause, when it has settled, whether to
  retry; a pure function of the events;
- attempts.py, the restart loop (``--restarts``, kernel/supervision/restarts.py).

:class:`Supervisor` routes each event: pipe output to the relay, frames to the board, rank 0's
results, a request for the closure's host copy to the run's handoff (given in the run's parts, as
``host_copy``), the data plane's coordinator (whose answers go back out), and everything to the
verdict; a display waits for its marker in the rank's text (output/displays.py).
:class:`AttemptWatch` steps it through one attempt, until it ends, fails, times out or is stopped.

The first failure stops every rank; the cell's error names that process, with what it
printed last. ``--timeout`` stops every rank and names those still running, and where each
was (the hang autopsy). Data workers are peers on the same channel (peers.py numbers them
after the ranks); a worker's failure stops the run like a rank's. The run ends when the
ranks end: workers still extracting then are stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from taas_magic import protocol
from taas_magic.autopsy.hangline import HangWatch
from taas_magic.errors import RunError, TrialPruned
from taas_magic.feed.coordinator import Send
from taas_magic.kernel.supervision import attempts as attempt_loop
from taas_magic.kernel.supervision.dataplane import DataPlane
from taas_magic.kernel.supervision.mux import Event, FrameArrived, Greeting, Mux, Output, OutputEnded, PeerConnected, PeerExited
from taas_magic.kernel.supervision.prompts import PromptDesk, RankPrompts
from taas_magic.kernel.supervision.restarts import Attempts
from taas_magic.kernel.supervision.server import PeerServer
from taas_magic.kernel.supervision.verdict import TimedOut, Verdict
from taas_magic.launch.contract import ProcessGroup
from taas_magic.output.board import Board
from taas_magic.output.displays import HeldDisplays
from taas_magic.output.relay import OutputRelay, Publish
from taas_magic.peers import RANK, WORKER, Peer, PeerIds
from taas_magic.protocol import Suggest, Suggested
from taas_magic.transfer.results import keep_result

POLL_SECONDS = 0.05
COURIER_POLL_SECONDS = 0.005
PIPE_GRACE_SECONDS = 2.0  # after every rank exited, how long to wait for pipes to close
SETTLE_STEP_SECONDS = 0.01

MarkerHook = Callable[[Peer, int], None]  # a rank's display ``n`` belongs here in its text
Explain = Callable[[dict[int, str], tuple[int, ...]], list[str]]  # stack dumps, running ranks -> the autopsy's lines
HostCopy = Callable[[int, protocol.ClosureHostWanted], tuple[bytes, str]]  # rank, its request -> the reply frame, the cell's line
SuggestAnswer = Callable[[int, Suggest], Suggested]  # a search's trial answering a rank's suggestion (search/link.py)


def not_a_search(rank: int, frame: Suggest) -> Suggested:
    """The answer to a suggestion in a run that is not a search's trial."""
    return Suggested(frame.name, error="this run is not a search's trial")


def never() -> bool:
    return False


@dataclass(frozen=True)
class RunParts:
    """What supervising one cell's run takes, made from the run's parts (kernel/runs/execution.py)."""

    server: PeerServer
    ids: PeerIds
    greeting: Greeting  # the encoded frames each peer gets once connected
    relay: Callable[[MarkerHook], OutputRelay]  # the cell's relay, made with the supervisor's marker hook
    publish: Publish
    host_copy: HostCopy  # the run's closure handoff, answering a rank that cannot open its CUDA IPC handles
    board: Board | None = None  # the live chart and health line (output/board.py)
    timeout: float | None = None  # --timeout
    explain: Explain | None = None  # the hang autopsy (autopsy/stacks.py)
    stop_asked: Callable[[], bool] = never  # %taas stop, or an interrupt of the cell that waits for it
    suggest: SuggestAnswer = not_a_search  # a search's trial: the value of each suggestion, the same for every rank
    prune_asked: Callable[[], bool] = never  # a search's pruner stopped this trial: every rank, at once
    prompts: PromptDesk | None = None  # the ranks' pdb prompts and the person's answers (kernel/supervision/prompts.py)
    # a collective save's folder, named by a rank; a piece of a file from a host that does not see the repository (writes/)
    saves: Callable[[int, protocol.CheckpointSaved | protocol.FilePart], None] | None = None
    hang: HangWatch | None = None  # the hang line: a rank long in one collective said while it waits (autopsy/hangline.py)

    def reported(self, rank: int, frame: protocol.Report) -> None:
        """A rank's reports to the live board; its health's wait to the hang line."""
        if self.board is not None:
            self.board.add(rank, frame)
        if self.hang is not None:
            self.hang.saw(rank, frame.health)


@dataclass
class RunOutcome:
    result: protocol.Result | None  # rank 0's results; None if rank 0 ended with sys.exit(0)
    exit_codes: dict[int, int]


class Supervisor:
    """One cell's supervision over the data workers and the current attempt's ranks."""

    def __init__(self, parts: RunParts, data: DataPlane | None, kept: bool = False, mux: Mux | None = None):
        """``kept``: a cell on kept ranks (keptcell.py), over ``mux`` once they started (it watches them)."""
        self.parts, self.data, self.kept = parts, data, kept
        self.mux = mux if mux is not None else Mux(parts.server, parts.ids, parts.greeting)
        self.relay = parts.relay(self._on_marker)
        loader_name = data.coordinator.name_of if data is not None else lambda feed: "the registered loaders"
        self.verdict = Verdict(parts.ids.ranks, self._host, loader_name, kept=kept)
        self.displays = HeldDisplays(self.relay, parts.publish, parts.ids)
        self.group: ProcessGroup | None = None  # the current attempt's ranks (attach / detach)
        self.result: protocol.Result | None = None
        self.running: Callable[[], None] | None = None  # once per attempt, when every rank has connected
        self.debugging = RankPrompts(parts.prompts, parts.ids.ranks, self.mux)
        for worker in data.workers.children if data is not None else ():
            self.mux.watch(Peer(WORKER, worker.index), worker)

    # -- the attempt's ranks (attempts.py) -------------------------------------------------------
    def attach(self, group: ProcessGroup, running: Callable[[], None], watched: bool = False) -> None:  # watched: kept
        self.group, self.running = group, None if watched else running
        for rank in () if watched else group.children:
            self.mux.watch(Peer(RANK, rank.index), rank)

    def detach(self) -> None:
        """After an attempt's ranks were stopped: their last output, then forget them."""
        self.handle_all(self.mux.forget_ranks())
        self.verdict.next_attempt()
        self.debugging.next_attempt()
        self.displays.forget_ranks()
        self.result, self.group = None, None
        if self.data is not None:
            self.data.restart_ranks()

    def last_words(self, notes: tuple[str, ...]) -> RunError:
        """The root cause as the cell shows it: with what the failing process printed before it
        reported it (its pipes drained now), and ``notes`` after it."""
        assert self.verdict.failure is not None
        self.handle_all(self.mux.drain_pipes(self.verdict.cause))
        self.relay.flush(force=True)
        return self.verdict.failure.with_output(self.relay.last_lines(self.verdict.cause), notes)

    def stop_everything(self, group: ProcessGroup, graceful: bool = True) -> None:
        self.relay.mute()
        group.stop(graceful)
        if self.data is not None:
            self.data.workers.stop()

    # -- events -------------------------------------------------------------------------------
    def handle_all(self, events: Iterable[Event]) -> None:
        for event in events:  # one at a time: a handler may read more (a display's marker drains its channel)
            self._handle(event)

    def _handle(self, event: Event) -> None:
        self.verdict.saw(event)
        match event:
            case Output(peer=peer, stream=stream, data=data):
                self.relay.feed(peer, stream, data)
            case OutputEnded(peer=peer, stream=stream):
                self.relay.end_of_stream(peer, stream)
            case FrameArrived(peer=peer, frame=frame) if peer.is_rank:
                self._route(peer, frame)
            case FrameArrived(peer=worker, frame=protocol.Ready() | protocol.Exhausted() | protocol.Done() as frame) if self.data:
                self._send_all(self.data.coordinator.on_worker(worker.index, frame))
            case PeerExited(peer=peer) if peer.is_rank:
                self.debugging.exited(peer.index)
            case PeerConnected() if self.running is not None and self.mux.connected_ranks() == self.parts.ids.ranks:
                self.running()
                self.running = None

    def _route(self, rank: Peer, frame: protocol.ToKernel) -> None:
        match frame:
            case protocol.Display() | protocol.ClearOutput():
                self.displays.keep(rank, frame)
            case protocol.Report():
                self.parts.reported(rank.index, frame)
            case protocol.Result() if rank.index == 0:
                # CUDA storages sent as IPC handles are copied now, while rank 0 waits with them alive;
                # if they cannot be, it sends them again through host memory and that result is kept.
                kept, reply = keep_result(frame)
                if reply is not None:
                    self.mux.send(rank, reply)
                self.result = kept if kept is not None else self.result
            case protocol.ClosureHostWanted():
                reply, line = self.parts.host_copy(rank.index, frame)
                self.relay.notice(line)
                self.mux.send(rank, reply)
            case protocol.Suggest():
                self.mux.send(rank, protocol.encode(self.parts.suggest(rank.index, frame)))
            case protocol.Want() if self.data is not None:
                self._send_all(self.data.coordinator.on_rank(rank.index, frame))
            case protocol.Prompt() | protocol.Resumed():
                self.debugging.route(rank.index, frame)
            case protocol.CheckpointSaved() | protocol.FilePart() if self.parts.saves is not None:
                self.parts.saves(rank.index, frame)

    def _send_all(self, sends: list[Send]) -> None:
        """What the coordinator answered; in the cluster mode deliveries wait for their elements to
        reach their rank's host (launch/ray/courier.py)."""
        if self.data is not None and self.data.courier is not None:
            sends = self.data.courier.route(sends)
        for send in sends:
            self.mux.deliver(send.to, protocol.encode(send.frame))

    def _on_marker(self, peer: Peer, number: int) -> None:
        """A rank's display ``number`` belongs here in its text: publish it now."""
        if not self.displays.has(peer, number):
            self.handle_all(self.mux.drain_channel(peer))  # sent before the marker was written: it is buffered
        self.displays.show(peer, number)

    # -- one attempt ----------------------------------------------------------------------------
    def step(self, wait: float) -> None:
        self.handle_all(self.mux.events(wait))
        self.debugging.step()
        if self.data is not None and self.data.courier is not None:
            self._send_all([])  # deliveries whose elements reached their rank's host
        self.handle_all(self.mux.exits())
        self.relay.flush()
        if self.data is not None:
            self.data.progress.show()
        if self.parts.board is not None:
            self.parts.board.show()

    def watch(self) -> RunOutcome | None:
        """One attempt, until every rank finished (its outcome) or it failed (None; the verdict says how)."""
        return AttemptWatch(self).run()

    def outcome(self) -> RunOutcome:
        self.displays.show_leftovers()
        return RunOutcome(self.result, dict(self.verdict.exit_codes))

    def close(self, keep_mux: bool = False) -> None:
        """Whatever happened: the last output, the last chart, the data line; the mux unless kept ranks keep it."""
        self.relay.flush(force=True)
        if self.parts.board is not None:
            self.parts.board.show(force=True)  # the last reports, drawn
        if self.data is not None:
            self.data.workers.close()  # before measuring the cache: nothing writes to it any more
            self.data.progress.show(force=True, usage=self.data.usage())
        self.debugging.close()  # before the mux: a line typed at a prompt now is not sent
        if not keep_mux:
            self.mux.close()

    def _host(self, peer: Peer) -> str:
        """Where a rank or data worker of the run runs."""
        if peer.is_rank:
            assert self.group is not None  # a rank's frames and exits arrive only while its attempt is attached
            return self.group.children[peer.index].host
        assert self.data is not None
        return self.data.workers.children[peer.index].host


def _kept_output_read(supervisor: Supervisor) -> bool:
    """Kept ranks: each one's output of the cell read up to its end (output/relay.py's ``CELL_END``)."""
    ranks = [Peer(RANK, rank) for rank in range(supervisor.parts.ids.ranks)]
    for rank in ranks:
        if not supervisor.relay.cell_ended(rank):
            supervisor.handle_all(supervisor.mux.drain_pipes(rank))
    return all(supervisor.relay.cell_ended(rank) for rank in ranks)


class AttemptWatch:
    """One attempt watched: the supervisor stepped until every rank finished or it failed, within
    ``--timeout`` (which does not count the time a rank waits at a pdb prompt), a stop asked
    (``%taas stop``, an interrupt), or a search's pruner's say."""

    def __init__(self, supervisor: Supervisor):
        self.supervisor = supervisor
        self.timeout = supervisor.parts.timeout
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout
        if supervisor.parts.hang is not None:
            supervisor.parts.hang.forget()  # an attempt's ranks say their own waits

    def run(self) -> RunOutcome | None:
        """The outcome, or None: it failed (the verdict says how). An interrupt shows where every
        rank was (the autopsy; at a pdb prompt nothing is hung), then propagates; kept ranks are
        interrupted first, and only those that do not stop get the autopsy (keptcell.py)."""
        try:
            return self._loop()
        except KeyboardInterrupt:
            self.supervisor.relay.flush(force=True)
            self.explain_stop(autopsy=not self.supervisor.kept)
            raise

    def explain_stop(self, autopsy: bool = True) -> None:
        """Where the ranks still running were stopped: at their pdb prompts, or (``autopsy``) their stacks."""
        supervisor = self.supervisor
        for line in supervisor.debugging.stopped_lines() or (self.autopsy()[1] if autopsy else []):
            supervisor.relay.notice(line)

    def _loop(self) -> RunOutcome | None:
        supervisor, verdict = self.supervisor, self.supervisor.verdict
        all_exited_at: float | None = None
        before = time.monotonic()
        while True:
            supervisor.step(self._wait())
            if self.deadline is not None and supervisor.debugging.in_pdb:
                self.deadline += time.monotonic() - before
            before = time.monotonic()
            if verdict.failure is not None:
                if supervisor.kept:  # said at once, as a fact: what follows (the settle, the others' time) takes seconds
                    supervisor.relay.notice(f"taas: {str(verdict.failure).splitlines()[0]}")
                self._settle()
                return None
            now = time.monotonic()
            if verdict.ranks_exited() and supervisor.kept:  # every kept rank said CellDone: its output's end read?
                all_exited_at = all_exited_at or now
                if _kept_output_read(supervisor) or now - all_exited_at > PIPE_GRACE_SECONDS:
                    return supervisor.outcome()
                continue
            if verdict.ranks_exited() and not supervisor.mux.rank_streams_open():
                return supervisor.outcome()
            if verdict.ranks_exited():
                all_exited_at = all_exited_at or now
                if now - all_exited_at > PIPE_GRACE_SECONDS:
                    return supervisor.outcome()  # something the cell started still holds a pipe open: the group's close ends it
            if supervisor.parts.stop_asked():
                raise KeyboardInterrupt  # as the person's interrupt: the autopsy, then every rank stopped
            if supervisor.parts.prune_asked():
                self._pruned()
            self._say_if_hung(now)
            if self.deadline is not None and now >= self.deadline:
                assert self.timeout is not None  # a deadline exists only with a timeout
                running, lines = self.autopsy()
                verdict.saw(TimedOut(self.timeout, running, tuple(lines)))
                return None

    def _say_if_hung(self, now: float) -> None:
        """The hang line when one is due (autopsy/hangline.py): where every rank is, and nothing stopped."""
        supervisor, hang = self.supervisor, self.supervisor.parts.hang
        if hang is None or supervisor.group is None or (waited := hang.due(now, bool(supervisor.debugging.in_pdb))) is None:
            return
        running = supervisor.verdict.running()
        supervisor.relay.notice(hang.line(supervisor.group.stacks(running), running, supervisor.parts.ids.ranks, waited))

    def _wait(self) -> float:
        """How long the next select may wait: until a flush, the deadline, or a courier's copies."""
        now = time.monotonic()
        wait = min(POLL_SECONDS, self.supervisor.relay.seconds_until_flush(now))
        if self.deadline is not None:
            wait = min(wait, max(0.0, self.deadline - now))
        data = self.supervisor.data
        if data is not None and data.courier is not None and data.courier.busy:
            wait = min(wait, COURIER_POLL_SECONDS)  # its copies complete off the selector
        return wait

    def _settle(self) -> None:
        """After a failure: a moment for a silent death that caused it to be seen (verdict.py)."""
        supervisor = self.supervisor
        failed_at = time.monotonic()
        while not supervisor.verdict.settled(time.monotonic() - failed_at):
            supervisor.handle_all(supervisor.mux.events(SETTLE_STEP_SECONDS))
            supervisor.handle_all(supervisor.mux.exits())

    def autopsy(self) -> tuple[tuple[int, ...], list[str]]:
        """The ranks still running, and where each of them is (stacks.py): one summary line, then the stacks."""
        supervisor = self.supervisor
        assert supervisor.group is not None
        running = supervisor.verdict.running()
        if supervisor.parts.explain is None or not running:
            return running, []
        return running, supervisor.parts.explain(supervisor.group.stacks(running), running)

    def _pruned(self) -> None:
        """A search's pruner stopped this trial: every rank at once (TERM, then KILL), no autopsy,
        so its GPUs go to the next trial now."""
        self.supervisor.relay.mute()
        if self.supervisor.group is not None:
            self.supervisor.group.stop(graceful=False)
        raise TrialPruned("taas: the search's pruner stopped this trial")


def show_start(parts: RunParts, plane: DataPlane | None) -> None:
    """The data workers' progress and the live board's displays, in their places above the ranks' output."""
    if plane is not None:
        plane.progress.show(force=True)
    if parts.board is not None:
        parts.board.start()


def run_ranks(parts: RunParts, start: Callable[[int], ProcessGroup], data: Callable[[], DataPlane] | None = None,
              attempts: Attempts | None = None) -> RunOutcome:
    """Start the data workers (if any), then the ranks (``start(attempt)``), and supervise them;
    a failed attempt starts again as ``attempts`` allows (attempts.py). Whatever happens, no rank
    or worker outlives the call."""
    plane = data() if data is not None else None
    supervisor = Supervisor(parts, plane)
    try:
        show_start(parts, plane)
        return attempt_loop.run(supervisor, start, attempts or Attempts())
    finally:
        supervisor.close()
