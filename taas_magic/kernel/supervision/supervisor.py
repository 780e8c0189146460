"""The router of one cell's supervision: every event the ranks and data workers cause, sent where it belongs.

Runs in the kernel, on the run's own thread (kernel/runs/background.py), the one thread that reads what a
cell's peers say and sends them frames, and installs no signal handler: a stop (``%taas stop``, or an
interrupt of the cell that waits for the run) is asked through ``stop_asked`` and raised by the watch
(attempts.py) as ``KeyboardInterrupt``. It is the middle of three parts, as torch's elastic agent keeps its
process context, its restart loop and its log tailing apart:

- mux.py, the mechanism: one selector over the listener, the handshakes, every process's pipes, channel
  and exit (a pidfd per local process, so the run ends the moment its last rank does), read as typed
  events; no threads to race;
- this module: :class:`Supervisor` routes each event: pipe output to the relay, frames to the board, rank
  0's results, a request for the closure's host copy to the run's handoff (given in the run's parts, as
  ``host_copy``), the data plane's coordinator (whose answers go back out), and everything to the verdict
  (verdict.py: which failure is the root cause, a pure function of the events); a display waits for its
  marker in the rank's text (output/displays.py);
- attempts.py, time: the one loop over attempts, each watched until it ends, fails, times out or is
  stopped, and what a failure costs as a policy of the ranks' lifetime (restarts.py, keptcell.py).

A failure names the process that failed, with what it printed last. Data workers are peers on the same
channel (peers.py numbers them after the ranks); a worker's failure fails the run like a rank's. The run
ends when the ranks end their cell: workers still extracting then are stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

from taas_magic import protocol
from taas_magic.autopsy.hangline import HangWatch
from taas_magic.debugger.ranklink import RankLink
from taas_magic.debugger.tracer import PanelReply, PanelResumed, PanelStopped
from taas_magic.errors import RunError
from taas_magic.feed.coordinator import Send
from taas_magic.kernel.supervision.dataplane import DataPlane
from taas_magic.kernel.supervision.mux import Event, FrameArrived, Greeting, Mux, Output, OutputEnded, PeerConnected, PeerExited
from taas_magic.kernel.supervision.prompts import PromptDesk, RankPrompts
from taas_magic.kernel.supervision.server import PeerServer
from taas_magic.kernel.supervision.verdict import Verdict
from taas_magic.launch.contract import ProcessGroup
from taas_magic.output.board import Board
from taas_magic.output.displays import HeldDisplays
from taas_magic.output.relay import ClearOutput, Display, OutputRelay, Publish
from taas_magic.output.reports import Report
from taas_magic.peers import RANK, WORKER, Peer, PeerIds
from taas_magic.profiling.window import ClockAsk, ClockTime, ProfileTrace
from taas_magic.search.trial import Suggest, Suggested
from taas_magic.transfer.handoff import ClosureHostWanted
from taas_magic.transfer.results import keep_result
from taas_magic.transfer.returns import Result
from taas_magic.writes.outbox import FilePart
from taas_magic.writes.savers import CheckpointSaved

SETTLE_STEP_SECONDS = 0.01

MarkerHook = Callable[[Peer, int], None]  # a rank's display ``n`` belongs here in its text
Watch = Callable[["Supervisor"], "RunOutcome | None"]  # one attempt stepped through (attempts.py's AttemptWatch)
Explain = Callable[[dict[int, str], tuple[int, ...]], list[str]]  # stack dumps, running ranks -> the autopsy's lines
HostCopy = Callable[[int, ClosureHostWanted], tuple[bytes, str]]  # rank, its request -> the reply frame, the cell's line
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
    saves: Callable[[int, CheckpointSaved | FilePart], None] | None = None
    profiled: Callable[[int, ProfileTrace], None] | None = None  # --profile: a rank's trace (kernel/runs/profiled.py)
    hang: HangWatch | None = None  # the hang line: a rank long in one collective said while it waits (autopsy/hangline.py)
    panel: RankLink | None = None  # the ranks as JupyterLab's debugger panel's threads (debugger/ranklink.py)

    def reported(self, rank: int, frame: Report) -> None:
        """A rank's reports to the live board; its health's wait to the hang line."""
        if self.board is not None:
            self.board.add(rank, frame)
        if self.hang is not None:
            self.hang.saw(rank, frame.health)


@dataclass
class RunOutcome:
    result: Result | None  # rank 0's results; None if rank 0 ended with sys.exit(0)
    exit_codes: dict[int, int]


class Router:
    """Where each event of one cell's peers goes (see the module docstring); it knows no process, only events."""

    def __init__(self, parts: RunParts, data: DataPlane | None, mux: Mux, verdict: Verdict):
        self.parts, self.data, self.mux, self.verdict = parts, data, mux, verdict
        self.relay = parts.relay(self._on_marker)
        self.displays = HeldDisplays(self.relay, parts.publish, parts.ids)
        self.debugging = RankPrompts(parts.prompts, parts.ids.ranks, mux)
        self.result: Result | None = None  # rank 0's, once it came
        self.running: Callable[[], None] | None = None  # once per attempt, when every rank has connected

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
                self.send_all(self.data.coordinator.on_worker(worker.index, frame))
            case PeerExited(peer=peer) if peer.is_rank:
                self.debugging.exited(peer.index)
            case PeerConnected() if self.running is not None and self.mux.connected_ranks() == self.parts.ids.ranks:
                self.running()
                self.running = None

    def _route(self, rank: Peer, frame: protocol.ToKernel) -> None:
        match frame:
            case Display() | ClearOutput():
                self.displays.keep(rank, frame)
            case Report():
                self.parts.reported(rank.index, frame)
            case Result() if rank.index == 0:
                # CUDA storages sent as IPC handles are copied now, while rank 0 waits with them alive;
                # if they cannot be, it sends them again through host memory and that result is kept.
                kept, reply = keep_result(frame)
                if reply is not None:
                    self.mux.send(rank, reply)
                self.result = kept if kept is not None else self.result
            case ClosureHostWanted():
                reply, line = self.parts.host_copy(rank.index, frame)
                self.relay.notice(line)
                self.mux.send(rank, reply)
            case Suggest():
                self.mux.send(rank, protocol.encode(self.parts.suggest(rank.index, frame)))
            case protocol.Want() if self.data is not None:
                self.send_all(self.data.coordinator.on_rank(rank.index, frame))
            case protocol.Prompt() | protocol.Resumed():
                self.debugging.route(rank.index, frame)
            case PanelStopped(reason=reason, line=line) if self.parts.panel is not None:
                self.parts.panel.stopped_at(rank.index, reason, line)
            case PanelReply(seq=seq) if self.parts.panel is not None:
                self.parts.panel.replied(seq, frame)
            case PanelResumed(stepping=stepping) if self.parts.panel is not None:
                self.parts.panel.continued(rank.index, stepping)
            case CheckpointSaved() | FilePart() if self.parts.saves is not None:
                self.parts.saves(rank.index, frame)
            case ClockAsk():  # --profile: the rank's clock against ours (profiling/window.py)
                self.mux.send(rank, protocol.encode(ClockTime(time.time_ns())))
            case ProfileTrace() if self.parts.profiled is not None:
                self.parts.profiled(rank.index, frame)

    def send_all(self, sends: list[Send]) -> None:
        """What the coordinator answered; in the cluster mode deliveries wait for their elements to
        reach their rank's host (launch/ray/courier.py)."""
        if self.data is not None and self.data.courier is not None:
            sends = self.data.courier.route(sends)
        for send in sends:
            self.mux.deliver(send.to, protocol.encode(send.frame))

    def _on_marker(self, peer: Peer, number: int) -> None:
        """A rank's display ``number`` belongs here in its text: publish it now."""
        if not self.displays.has(peer, number):
            self.handle_all(self.mux.channels.drain(peer))  # sent before the marker was written: it is buffered
        self.displays.show(peer, number)

    def forget_ranks(self) -> None:
        """An attempt's ranks were stopped: their last output, then nothing of them is kept."""
        self.handle_all(self.mux.forget_ranks())
        self.verdict.next_attempt()
        self.debugging.next_attempt()
        self.displays.forget_ranks()
        self.result = None


class Supervisor:
    """One cell's supervision over its data workers and the current attempt's ranks: their events routed
    (:class:`Router`), stepped, and what the cell shows when they end or are stopped."""

    def __init__(self, parts: RunParts, data: DataPlane | None, mux: Mux, watch: Watch, clean_exit: str | None = None):
        """Over ``mux`` (its owner closes it: the run, or kept ranks' set); ``watch`` steps it through an attempt
        (attempts.py's); ``clean_exit``: what a rank's exit with code 0 is (verdict.py)."""
        self.parts, self.data, self.mux, self._watch = parts, data, mux, watch
        loader_name = data.coordinator.name_of if data is not None else lambda feed: "the registered loaders"
        self.verdict = Verdict(parts.ids.ranks, self._host, loader_name, clean_exit=clean_exit)
        self.router = Router(parts, data, mux, self.verdict)
        self.relay, self.debugging, self.handle_all = self.router.relay, self.router.debugging, self.router.handle_all
        self.group: ProcessGroup | None = None  # the current attempt's ranks (attach / detach)
        for worker in data.workers.children if data is not None else ():
            self.mux.watch(Peer(WORKER, worker.index), worker)

    # -- the attempt's ranks (attempts.py) -------------------------------------------------------
    def attach(self, group: ProcessGroup, running: Callable[[], None]) -> None:
        """The attempt's ranks, watched (kept ranks are already: watching them again does nothing)."""
        self.group, self.router.running = group, running
        for rank in group.children:
            self.mux.watch(Peer(RANK, rank.index), rank)
        if self.parts.panel is not None:
            self.parts.panel.attach(self.mux.wake, {rank.index: rank.host for rank in group.children})

    def detach(self) -> None:
        """After an attempt's ranks were stopped: their last output, then forget them."""
        self.router.forget_ranks()
        self.group = None
        if self.data is not None:
            self.data.restart_ranks()

    def last_words(self, notes: tuple[str, ...]) -> RunError:
        """The root cause as the cell shows it: with what the failing process printed before it
        reported it (its pipes drained now), and ``notes`` after it."""
        assert self.verdict.failure is not None
        self.handle_all(self.mux.drain_pipes(self.verdict.cause))
        self.relay.flush(force=True)
        return self.verdict.failure.with_output(self.relay.last_lines(self.verdict.cause), notes)

    def explain_stop(self, autopsy: bool = True) -> None:
        """Where the ranks still running were stopped: at their pdb prompts, or (``autopsy``) their stacks."""
        for line in self.debugging.stopped_lines() or (self.autopsy()[1] if autopsy else []):
            self.relay.notice(line)

    def autopsy(self) -> tuple[tuple[int, ...], list[str]]:
        """The ranks still running, and where each of them is (stacks.py): one summary line, then the stacks."""
        assert self.group is not None
        running = self.verdict.running()
        if self.parts.explain is None or not running:
            return running, []
        return running, self.parts.explain(self.group.stacks(running), running)

    def stop_everything(self, group: ProcessGroup, graceful: bool = True) -> None:
        self.relay.mute()
        group.stop(graceful)
        if self.data is not None:
            self.data.workers.stop()

    # -- one attempt ----------------------------------------------------------------------------
    def show_start(self) -> None:
        """The data workers' progress and the live board's displays, in their places above the ranks' output."""
        if self.data is not None:
            self.data.progress.show(force=True)
        if self.parts.board is not None:
            self.parts.board.start()

    def step(self, wait: float) -> None:
        self.handle_all(self.mux.events(wait))
        panel = self.parts.panel
        if panel is not None:
            for rank, body in panel.outgoing():
                self.mux.send(Peer(RANK, rank), body)
        self.debugging.step(held=panel is not None and bool(panel.stopped))  # a rank stopped in the panel holds the rest
        if self.data is not None and self.data.courier is not None:
            self.router.send_all([])  # deliveries whose elements reached their rank's host
        self.handle_all(self.mux.exits())
        self.relay.flush()
        if self.data is not None:
            self.data.progress.show()
        if self.parts.board is not None:
            self.parts.board.show()

    def watch(self) -> RunOutcome | None:
        """One attempt, until every rank ended its cell (its outcome) or it failed (None; the verdict says how)."""
        return self._watch(self)

    def pump(self, seconds: float) -> None:
        """What arrives within ``seconds``, and the exits since, handled (a failure's settling, kept ranks' wait)."""
        self.handle_all(self.mux.events(seconds))
        self.handle_all(self.mux.exits())

    def settle(self) -> None:
        """After a failure: a moment for a silent death that caused it to be seen (verdict.py)."""
        failed_at = time.monotonic()
        while not self.verdict.settled(time.monotonic() - failed_at):
            self.pump(SETTLE_STEP_SECONDS)

    def output_read(self) -> bool:
        """Every rank's output of the cell read to its end: both its streams' (output/relay.py: the pipe closed,
        or a kept rank's ``CELL_END``), and the channel of a rank that exited closed (its last frames read)."""
        ranks = [Peer(RANK, rank) for rank in range(self.parts.ids.ranks)]
        for rank in ranks:
            if not self.relay.cell_ended(rank):
                self.handle_all(self.mux.drain_pipes(rank))
        return all(self.relay.cell_ended(rank) and not self.mux.exited_connected(rank) for rank in ranks)

    def outcome(self) -> RunOutcome:
        self.router.displays.show_leftovers()
        return RunOutcome(self.router.result, dict(self.verdict.exit_codes))

    def close(self) -> None:
        """Whatever happened: the last output, the last chart, the data line (the mux is its owner's to close)."""
        self.relay.flush(force=True)
        if self.parts.board is not None:
            self.parts.board.show(force=True)  # the last reports, drawn
        if self.data is not None:
            self.data.workers.close()  # before measuring the cache: nothing writes to it any more
            self.data.progress.show(force=True, usage=self.data.usage())
        self.debugging.close()  # before the mux: a line typed at a prompt now is not sent
        if self.parts.panel is not None:
            self.parts.panel.close()

    def _host(self, peer: Peer) -> str:
        """Where a rank or data worker of the run runs."""
        if peer.is_rank:
            assert self.group is not None  # a rank's frames and exits arrive only while its attempt is attached
            return self.group.children[peer.index].host
        assert self.data is not None
        return self.data.workers.children[peer.index].host
