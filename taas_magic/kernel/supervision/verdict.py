"""How a run failed, as a pure function of what happened: events in, a verdict out; no I/O, no clock.

Runs in the kernel, on the run's own thread, fed by the supervisor.

The supervisor feeds it every event (mux.py) and the timeout (:class:`TimedOut`); it keeps
what the policy needs and decides (as torch's elastic agent keeps its restart policy apart
from its processes, and ``errors/__init__.py`` names the first failure the root cause):

- what a failure is: a rank's error report (``RankError``), a data worker's (``WorkerFailure``),
  a frame that failed authentication or decoding, a non-zero exit without a report, a data
  worker that exited cleanly before it said ``Done`` (the ranks would wait for its share
  forever), or ``--timeout``;
- the root cause: the first failure, except that a rank which died without a word (a
  signal, the OOM killer) is the cause of the errors its peers' collectives raise at the
  same moment, whichever the kernel read first: the silent-death rule;
- a kept rank's ``CellDone`` (``--keep``): its cell is over, as an exit is, though the rank lives on; and what
  a rank's exit with code 0 is, given as data by the ranks' policy: the end of its cell, or (kept ranks) a failure;
- settling: after a failure, how long a silent death may still claim to be the cause
  (:data:`SETTLE_SECONDS`, unless the cause is already silent or every rank has exited);

The error it holds is built whole from what it was fed; what the failing process printed
last is added by the supervisor, which builds the error the cell shows anew
(``RunError.with_output``). One verdict serves a run: :meth:`Verdict.next_attempt` forgets
the ranks of a failed attempt and keeps what the data workers said.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from taas_magic.errors import Failure, PeerFailed, RunError, RunTimeout, describe_exit
from taas_magic.kernel.supervision.mux import Event, FrameArrived, FrameRefused, PeerExited
from taas_magic.peers import RANK, Peer
from taas_magic.protocol import CellDone, Done, RankError, WorkerFailure

SETTLE_SECONDS = 0.25  # after a rank's error, how long a silent death may still claim to be the cause


@dataclass(frozen=True)
class TimedOut:
    """``--timeout`` passed with ``running`` ranks still running; ``notes``: where they were."""

    timeout: float
    running: tuple[int, ...]
    notes: tuple[str, ...] = ()


def _no_loader(feed: int | None) -> str:
    return "the registered loaders"


@dataclass
class Verdict:
    ranks: int
    host: Callable[[Peer], str]  # where a peer runs, for the error
    loader: Callable[[int | None], str] = _no_loader  # a feed's name in the notebook, for a worker's error
    failure: RunError | None = None  # the root cause so far
    cause: Peer = Peer(RANK, 0)  # the process that failed (the timeout: the first rank still running)
    silent: bool = False  # the cause died without reporting an error
    exits: dict[Peer, int] = field(default_factory=dict)
    reported: set[Peer] = field(default_factory=set)  # ranks that sent an error report
    # what a rank's exit with code 0 is: None, the end of its cell; else the failure (kept ranks outlive their cells)
    clean_exit: str | None = None
    workers_done: set[int] = field(default_factory=set)
    held: dict[int, CellDone] = field(default_factory=dict)  # each kept rank's end of its cell: what it holds now

    def saw(self, event: Event | TimedOut) -> None:
        match event:
            case FrameArrived(peer=peer, frame=RankError() as report) if peer.is_rank:
                self.reported.add(peer)
                what = Failure(report.summary, report.traceback, report.signature, report.frames)
                self._fail(PeerFailed(peer, self.host(peer), what), peer)
            case FrameArrived(peer=peer, frame=WorkerFailure() as report) if not peer.is_rank:
                self._fail(PeerFailed.from_worker_report(peer, self.host(peer), self.loader(report.feed), report), peer)
            case FrameArrived(peer=peer, frame=CellDone(raised=raised) as done) if peer.is_rank:
                self.exits[peer] = 1 if raised else 0  # a kept rank ended its cell and lives on (its report went first)
                self.held[peer.index] = done
            case FrameArrived(peer=peer, frame=Done()) if not peer.is_rank:
                self.workers_done.add(peer.index)
            case FrameRefused(peer=peer, why=why):
                self._fail(self._failed(peer, why), peer)
            case PeerExited(peer=peer, code=code):
                self._exited(peer, code)
            case TimedOut(timeout=timeout, running=running, notes=notes):
                self._fail(RunTimeout(timeout, running, notes), Peer(RANK, running[0] if running else 0))

    def _exited(self, peer: Peer, code: int) -> None:
        self.exits[peer] = code
        if code == 0 and peer.is_rank and self.clean_exit is not None:
            self._fail(self._failed(peer, self.clean_exit), peer, silent=True)
        elif code != 0:
            if peer not in self.reported:
                self._fail(self._failed(peer, describe_exit(code) + " without reporting an error"), peer, silent=True)
        elif not peer.is_rank and peer.index not in self.workers_done:
            self._fail(self._failed(peer, "exited before preparing its share of the elements"), peer)

    def _failed(self, peer: Peer, summary: str) -> RunError:
        return PeerFailed(peer, self.host(peer), Failure(summary))

    def _fail(self, failure: RunError, peer: Peer, silent: bool = False) -> None:
        if silent and self.failure is not None and not self.silent and self.cause != peer:
            self.failure = None  # the silent-death rule (see the module's docstring)
        if self.failure is None:  # the root cause is the first failure
            self.failure, self.cause, self.silent = failure, peer, silent

    def settled(self, waited: float) -> bool:
        """After a failure, ``waited`` seconds ago: whether a silent death can no longer claim to be its cause."""
        return self.silent or self.ranks_exited() or waited >= SETTLE_SECONDS

    def ranks_exited(self) -> bool:
        return sum(peer.is_rank for peer in self.exits) == self.ranks

    def running(self) -> tuple[int, ...]:
        """The ranks not seen to exit."""
        return tuple(rank for rank in range(self.ranks) if Peer(RANK, rank) not in self.exits)

    @property
    def exit_codes(self) -> dict[int, int]:
        """Each rank's exit code, by RANK (what the run's outcome reports)."""
        return {peer.index: code for peer, code in self.exits.items() if peer.is_rank}

    def next_attempt(self) -> None:
        """The attempt's ranks are gone: forget them (the data workers and what they said stay)."""
        self.exits = {peer: code for peer, code in self.exits.items() if not peer.is_rank}
        self.reported.clear()
        self.failure, self.cause, self.silent = None, Peer(RANK, 0), False
