"""One cell on kept ranks (``--keep``): started once, then given each cell, and never lost to a bad one.

Runs in the kernel, on the run's own thread (kernel/runs/background.py), with the supervisor.

Kept ranks are a :class:`KeptGroup`: their processes and the selector that watches their pipes, channels
and exits (mux.py), kept from cell to cell by the session (kernel/runs/rankset.py). A cell on them:

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
- an interrupt (``%taas stop``, the person's) is sent to every rank as SIGINT (an ``Interrupt`` frame):
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
from typing import Callable

from taas_magic import protocol
from taas_magic.errors import PeerFailed, RunError, RunTimeout, describe_exit
from taas_magic.kernel.supervision.dataplane import DataPlane
from taas_magic.kernel.supervision.mux import Mux
from taas_magic.kernel.supervision.supervisor import AttemptWatch, RunOutcome, RunParts, Supervisor, show_start
from taas_magic.launch.contract import ProcessGroup
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
    greeted: bool = False  # the next cell's frames were sent already (:meth:`greet`)
    seen_alive_at: float = float("-inf")  # when every rank was last seen alive (:attr:`running`)

    def greet(self, bodies: list[bytes], ranks: int) -> None:
        """Send a cell's frames (its spec and closure) to every rank now, from the cell's thread as its run starts:
        the ranks begin the cell about a millisecond sooner than when its run's thread is up and sends them, which
        then only supervises it (:func:`run_kept_cell`). Only for running ranks, and a cell without data workers
        (those start first): the caller has just seen them running. What the ranks answer waits in their channels
        until the run's thread reads it."""
        assert self.mux is not None
        for rank in range(ranks):
            for body in bodies:
                self.mux.send(Peer(RANK, rank), body)
        self.greeted = True

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


def run_kept_cell(parts: RunParts, ranks: KeptGroup, start: Callable[[int], ProcessGroup],
                  data: Callable[[], DataPlane] | None = None) -> RunOutcome:
    """The cell on ``ranks`` (started now by ``start(0)`` if they are not running) and its data workers
    (``data()``, started first), supervised until every rank ended it; see the module docstring for what is
    kept when it fails or is interrupted."""
    fresh, greeted, ranks.greeted = not ranks.running, ranks.greeted, False
    if fresh:
        ranks.close()  # a group whose rank died between cells: what is left of it
        ranks.lost = None
        parts.server.readmit(range(parts.ids.ranks))  # the new ranks prove the same key on the same listener
    else:
        assert ranks.mux is not None
        ranks.mux.channels.ids, ranks.mux.channels.greeting = parts.ids, parts.greeting  # this cell's peers and frames
    parts.server.readmit(range(parts.ids.ranks, len(parts.ids)))  # this cell's data workers, as the last cell's
    plane = data() if data is not None else None
    supervisor = Supervisor(parts, plane, kept=True, mux=None if fresh else ranks.mux)
    kept = False
    try:
        if fresh:
            show_start(parts, plane)
            ranks.group = start(0)
            ranks.mux = supervisor.mux
            supervisor.attach(ranks.group, lambda: None)
        else:  # the cell first, then its displays: the ranks' output is read only after them, so it comes below them
            assert ranks.group is not None
            supervisor.attach(ranks.group, lambda: None, watched=True)
            for rank in range(parts.ids.ranks) if not greeted else ():  # (the cell's thread may have sent them)
                for body in parts.greeting(Peer(RANK, rank)):
                    supervisor.mux.send(Peer(RANK, rank), body)
            show_start(parts, plane)
        try:
            outcome = supervisor.watch()
        except KeyboardInterrupt:
            kept = _interrupted(supervisor)
            raise
        if outcome is not None:
            kept = True
            return outcome
        # the others end their cell (they all raised), or are interrupted: a rank in Python code then ends it too
        kept = (not isinstance(supervisor.verdict.failure, RunTimeout) and _wait_for_every_cell(supervisor, KEEP_WAIT_SECONDS)
                or _interrupt_every_rank(supervisor))
        failure: RunError = supervisor.last_words(
            (KEPT_LINE,) if kept else (lost_line("not every rank ended its cell after the failure, even interrupted"),))
        raise failure.on_kept_ranks() if kept and isinstance(failure, (PeerFailed, RunTimeout)) else failure
    finally:
        supervisor.mux.channels.greeting = _no_greeting  # the mux outlives the cell: not its frames
        if not kept:
            ranks.lost = ranks.lost or "every rank was stopped"
            if ranks.group is not None:  # TERM, then KILL: they had their SIGINT, or their time to end the cell
                supervisor.stop_everything(ranks.group, graceful=False)
        supervisor.close(keep_mux=kept)
        if kept:
            supervisor.mux.forget_workers()  # stopped with the cell
        else:
            ranks.mux = None  # closed with the supervisor
            ranks.close()


def _no_greeting(peer: Peer) -> list[bytes]:
    return []


def _interrupted(supervisor: Supervisor) -> bool:
    """The person's interrupt: every rank interrupted; where those that did not stop are (the autopsy: in C
    code or a collective), and the cell says what was kept."""
    kept = _interrupt_every_rank(supervisor, INTERRUPT_WAIT_SECONDS)
    if not kept:
        AttemptWatch(supervisor).explain_stop()
    supervisor.relay.notice(KEPT_LINE if kept else lost_line("a rank did not stop in time (in C code or a collective)"))
    return kept


def _interrupt_every_rank(supervisor: Supervisor, seconds: float = FAILURE_INTERRUPT_SECONDS) -> bool:
    """SIGINT in every rank still in its cell (an ``Interrupt`` frame); whether each ended it within ``seconds``."""
    for rank in supervisor.verdict.running():
        supervisor.mux.send(Peer(RANK, rank), protocol.encode(protocol.Interrupt()))
    return _wait_for_every_cell(supervisor, seconds)


def _wait_for_every_cell(supervisor: Supervisor, seconds: float) -> bool:
    """Whether every rank ended its cell (said CellDone) within ``seconds``, and is alive."""
    deadline = time.monotonic() + seconds
    verdict = supervisor.verdict
    while not verdict.ranks_exited() and time.monotonic() < deadline:
        supervisor.handle_all(supervisor.mux.events(STEP_SECONDS))
        supervisor.handle_all(supervisor.mux.exits())
    return verdict.ranks_exited() and supervisor.group is not None and _alive(supervisor.group)


def _alive(group: ProcessGroup) -> bool:
    return all(child.poll() is None for child in group.children)
