"""Keep-on-failure, the policy of kept ranks (``--keep``): started once, then given each cell, and never lost to a
bad one.

Runs in the kernel, on the run's own thread (kernel/runs/background.py), as a :class:`Policy` of the one loop
(attempts.py); that thread alone sends a cell's frames to the ranks.

Kept ranks are a :class:`KeptGroup`: their processes and the selector that watches their pipes, channels
and exits (mux.py), kept from cell to cell by their rank set (kernel/runs/rankset.py). A cell on them:

- the first starts them as a run starts its ranks; each later one sends every rank its spec and closure
  over the channel it already has, and the mux goes on watching them where the last cell left off;
- it ends when every rank said ``CellDone`` (rank/betweencells.py), after what it printed, rank 0 after its
  results; its output is read up to there, and the ranks stay;
- a rank that raised sends its report and then ``CellDone``: the cell fails with that error. If every
  rank's cell is over within :data:`KEEP_WAIT_SECONDS` (they all raised, or the others were done), the
  ranks are kept, globals and group: as IPython keeps a kernel. Those still in their cell are interrupted
  then, and kept if they all end it within :data:`FAILURE_INTERRUPT_SECONDS` (a rank in Python code does);
  a rank that still runs waits in a collective for the one that failed (or in C code), so every rank is
  stopped, and their state is lost: the cell says so. A kept rank that exits, even with 0, has failed;
- an interrupt (``%taas stop``, the person's) is sent to every rank as SIGINT, by an ``Interrupt`` frame (the
  process group a kept cell sees, :class:`FramedInterrupts`, interrupts by frame where a cell's own ranks' group
  signals: the frame names the cell, so one that comes late interrupts nothing):
  a cell stopped in Python code ends on every rank within :data:`INTERRUPT_WAIT_SECONDS` and the ranks are
  kept (no autopsy: each rank's traceback says where it was); one stuck in C code or a collective gets the
  autopsy (where it is), then is stopped with the others, and their state is lost;
- ``--timeout`` names the ranks still running and where they were, as in any run, then interrupts them:
  ranks stopped in Python code are kept;
- a rank that dies is named as in any run; the others are stopped with it.

A cell's data workers are its own: started with it, stopped when its ranks end it, then forgotten by the
kept selector. There are no restarts here (``--restarts`` with ``--keep`` is refused).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType
from typing import Callable, Sequence

from taas_magic import protocol
from taas_magic.errors import PeerFailed, RunError, RunTimeout, describe_exit
from taas_magic.kernel.supervision.attempts import Judged, Supervised
from taas_magic.kernel.supervision.mux import Mux
from taas_magic.kernel.supervision.supervisor import RunParts
from taas_magic.launch.contract import ChildProcess, ProcessGroup
from taas_magic.peers import RANK, Peer

KEEP_WAIT_SECONDS = 1.0  # after a rank's error, how long the others may take to end their cell before they are interrupted
INTERRUPT_WAIT_SECONDS = 3.0  # after the person's interrupt, how long every rank may take to end its cell
FAILURE_INTERRUPT_SECONDS = 1.5  # after a failure, how long the interrupted ranks may take (the error waits for it)
STEP_SECONDS = 0.02
ALIVE_RECHECK_SECONDS = 0.05  # kept ranks seen alive this recently are not polled again (KeptGroup.running)
KEPT_LINE = "taas: the ranks are kept, with their globals and their process group: the next --keep cell runs in them"


def lost_line(why: str) -> str:
    return f"taas: {why}: every rank was stopped and their state is lost; the next --keep cell starts new ranks"


@dataclass
class KeptGroup:
    """Kept ranks as supervision sees them: their processes and the selector watching them, once started."""

    group: ProcessGroup | None = None
    mux: Mux | None = None
    lost: str | None = None  # why they are gone (their state with them), once they are
    seen_alive_at: float = float("-inf")  # when every rank was last seen alive (:attr:`running`)

    def ended_why(self) -> str | None:
        """Why ranks that were started no longer run (a cell stopped them, a rank died), or None."""
        if self.lost is not None or self.group is None:
            return self.lost
        dead = [(child.index, code) for child in self.group.children if (code := child.poll()) is not None]
        return "; ".join(f"rank {index} {describe_exit(code)}" for index, code in dead) or None

    @property
    def running(self) -> bool:
        """Started, and every rank still alive (a rank may die between cells: the next cell starts new ones).
        A cell's plan asks several times within a few milliseconds; their processes are polled at most once in
        :data:`ALIVE_RECHECK_SECONDS` (a rank that dies meanwhile fails the cell as any dying rank does)."""
        if self.group is None or self.lost is not None:
            return False
        now = time.monotonic()
        if now - self.seen_alive_at > ALIVE_RECHECK_SECONDS:
            if not _alive(self.group):
                return False
            self.seen_alive_at = now
        return True

    def close(self) -> None:
        """Their channels closed (they leave on their own: rank/betweencells.py), then the group closed: its stop
        ladder's first grace is their time to leave (between cells a kept rank ignores the SIGINT it starts with)."""
        mux, group, self.mux, self.group = self.mux, self.group, None, None
        self.seen_alive_at = float("-inf")
        if mux is not None:
            mux.close()
        if group is not None:
            group.close()


class Keeping:
    """The policy of kept ranks (attempts.py's :class:`Policy`; see the module docstring): one attempt, on ``ranks``
    (started now by ``start(0)`` if they are not running)."""

    clean_exit: str | None = "exited in a kept cell (code 0) instead of ending it"  # a kept rank that exits has failed

    def __init__(self, ranks: KeptGroup, start: Callable[[int], ProcessGroup], run_id: str):
        self.ranks, self._start, self.run_id = ranks, start, run_id
        self.fresh = not ranks.running
        self.kept = False  # whether the ranks outlive the cell (its attempt said so)

    def mux(self, parts: RunParts) -> Mux:
        """The kept ranks' selector, its peers and frames this cell's, and the cell sent to each rank now, the
        run's first step (they begin it while its supervision is made); new ranks' new selector."""
        ranks = self.ranks
        if self.fresh:
            ranks.close()  # a group whose rank died between cells: what is left of it
            ranks.lost = None
            parts.server.readmit(range(parts.ids.ranks))  # the new ranks prove the same key on the same listener
            ranks.mux = Mux(parts.server, parts.ids, parts.greeting)
        else:
            assert ranks.mux is not None and ranks.group is not None
            ranks.mux.channels.ids, ranks.mux.channels.greeting = parts.ids, parts.greeting
            for rank in range(len(ranks.group.children)):
                for body in parts.greeting(Peer(RANK, rank)):
                    ranks.mux.send(Peer(RANK, rank), body)
        parts.server.readmit(range(parts.ids.ranks, len(parts.ids)))  # this cell's data workers, as the last cell's
        return ranks.mux

    def start(self, supervisor: Supervised, attempt: int) -> ProcessGroup:
        """New ranks after their displays; running ones had the cell (:meth:`mux`), then its displays go out: their
        output is read only after them, so it comes below them."""
        assert not attempt, "a kept cell has one attempt"
        supervisor.show_start()
        if self.fresh:
            self.ranks.group = self._start(0)
        assert self.ranks.group is not None and self.ranks.mux is not None
        return FramedInterrupts(self.ranks.group, self.ranks.mux, self.run_id)

    def running(self, attempt: int) -> Callable[[], None]:
        return _nothing

    def interrupted(self, supervisor: Supervised, group: ProcessGroup) -> bool:
        """Every rank interrupted; where those that did not stop are (the autopsy: in C code or a collective)."""
        kept = _interrupt_every_rank(supervisor, group, self.ranks, INTERRUPT_WAIT_SECONDS)
        if not kept:
            supervisor.explain_stop()
        supervisor.relay.notice(KEPT_LINE if kept else lost_line("a rank did not stop in time (in C code or a collective)"))
        return kept

    def failed(self, supervisor: Supervised, group: ProcessGroup, attempt: int, previous: RunError | None) -> Judged:
        """Said at once, as a fact (the others' time takes seconds); then the others end their cell (they all raised),
        or are interrupted: a rank in Python code then ends it too, and the ranks are kept."""
        verdict = supervisor.verdict
        assert verdict.failure is not None, "only a failed attempt is judged"
        supervisor.relay.notice(f"taas: {str(verdict.failure).splitlines()[0]}")
        kept = (not isinstance(verdict.failure, RunTimeout) and _wait_for_every_cell(supervisor, self.ranks, KEEP_WAIT_SECONDS)
                or _interrupt_every_rank(supervisor, group, self.ranks, FAILURE_INTERRUPT_SECONDS))
        failure = supervisor.last_words(
            (KEPT_LINE,) if kept else (lost_line("not every rank ended its cell after the failure, even interrupted"),))
        return Judged(failure.on_kept_ranks() if kept and isinstance(failure, (PeerFailed, RunTimeout)) else failure,
                      outlived=kept)

    def attempt_over(self, supervisor: Supervised, group: ProcessGroup, outlived: bool) -> None:
        """Ranks that do not outlive the cell: TERM, then KILL (they had their SIGINT, or their time to end it)."""
        self.kept = outlived
        if not outlived:
            supervisor.stop_everything(group, graceful=False)

    def close(self) -> None:
        """The cell's data workers forgotten (stopped with it), the ranks watched on; or, lost, closed."""
        mux = self.ranks.mux
        if mux is not None:
            mux.channels.greeting = _no_greeting  # the mux outlives the cell: not its frames
        if self.kept and mux is not None:
            mux.forget_workers()
        else:
            self.ranks.lost = self.ranks.lost or "every rank was stopped"
            self.ranks.close()



class FramedInterrupts:
    """Kept ranks' process group as one cell of theirs sees it (launch/contract.py's ``ProcessGroup``): the engine's
    processes, stacks and stop, but :meth:`interrupt` is an ``Interrupt`` frame naming the cell's run, sent on each
    rank's channel behind the cell's own frames (rank/betweencells.py: SIGINT to its process group), where a cell's
    own ranks are signalled: a signal that came late would interrupt the next cell, a frame for an old run is
    dropped. Closing it leaves the ranks running (their rank set closes them)."""

    def __init__(self, group: ProcessGroup, mux: Mux, run_id: str):
        self.group, self.mux, self.run_id = group, mux, run_id

    @property
    def children(self) -> Sequence[ChildProcess]:
        return self.group.children

    def interrupt(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            self.mux.send(Peer(RANK, rank), protocol.encode(protocol.Interrupt(self.run_id)))

    def stop(self, graceful: bool = True) -> list[str]:
        return self.group.stop(graceful)

    def stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        return self.group.stacks(ranks)

    def close(self) -> None:
        """Nothing: kept ranks outlive their cell's attempt (:meth:`Keeping.close` decides)."""

    def __enter__(self) -> FramedInterrupts:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _interrupt_every_rank(supervisor: Supervised, group: ProcessGroup, ranks: KeptGroup, seconds: float) -> bool:
    """Every rank still in its cell interrupted (``group``'s way); whether each ended it within ``seconds``."""
    group.interrupt(supervisor.verdict.running())
    return _wait_for_every_cell(supervisor, ranks, seconds)


def _nothing() -> None:
    return None


def _no_greeting(peer: Peer) -> list[bytes]:
    return []


def _wait_for_every_cell(supervisor: Supervised, ranks: KeptGroup, seconds: float) -> bool:
    """Whether every rank ended its cell (said CellDone) within ``seconds``, and is alive."""
    deadline = time.monotonic() + seconds
    verdict = supervisor.verdict
    while not verdict.ranks_exited() and time.monotonic() < deadline:
        supervisor.pump(STEP_SECONDS)
    return verdict.ranks_exited() and ranks.group is not None and _alive(ranks.group)


def _alive(group: ProcessGroup) -> bool:
    return all(child.poll() is None for child in group.children)
