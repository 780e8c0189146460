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
- a rank that raised sends its report and then ``CellDone``: the cell fails with that error. The others may end
  their cell within :data:`KEEP_WAIT_SECONDS` (they all raised, or were done); then every rank is sent ``Abandon``
  (:func:`_abandon_every_rank`): a rank still in the cell is interrupted, and every collective of its process groups
  ends with an error (rank/abortable.py: a rank that waits in one for the rank that raised leaves it), and the
  groups get a new communicator before the next cell. The ranks are kept, globals and groups, if every cell ended
  within :data:`FAILURE_INTERRUPT_SECONDS` of that; a rank that still runs is in C code that is not a collective,
  so every rank is stopped, and their state is lost: the cell says so. A kept rank that exits, even with 0, has failed;
- an interrupt (``%taas stop``, the person's) is sent to every rank as SIGINT, by an ``Interrupt`` frame (the
  process group a kept cell sees, :class:`FramedInterrupts`, interrupts by frame where a cell's own ranks' group
  signals: the frame names the cell, so one that comes late interrupts nothing): a cell stopped in Python code ends
  on every rank within :data:`INTERRUPT_WAIT_SECONDS`; one stuck in C code or a collective gets the autopsy (where
  it is), then ``Abandon`` as after a failure. Either way the ranks are kept if every cell ended, and their groups
  renewed (a collective left half done is not used again);
- ``--timeout`` names the ranks still running and where they were, as in any run, then abandons them as after a
  failure: their state is kept;
- a rank that dies (in a cell or between cells) is named as in any run; on CPU, the others are abandoned as after a
  failure and kept, and the next cell starts a new process in its place (replacement.py); one on GPUs stops every
  rank.

A cell's data workers are its own: started with it, stopped when its ranks end it, then forgotten by the
kept selector. There are no restarts here (``--restarts`` with ``--keep`` is refused).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Callable, Sequence

from taas_magic import protocol
from taas_magic.errors import LaunchError, PeerFailed, RunError, RunTimeout
from taas_magic.kernel.supervision import replacement
from taas_magic.kernel.supervision.attempts import Judged, Supervised
from taas_magic.kernel.supervision.mux import Mux
from taas_magic.kernel.supervision.replacement import Pending, ReplaceRank
from taas_magic.kernel.supervision.supervisor import RunParts
from taas_magic.launch.contract import ChildProcess, LaunchPlan, ProcessGroup
from taas_magic.peers import RANK, Peer
from taas_magic.protocol import CellDone

KEEP_WAIT_SECONDS = 0.5  # after a rank's error, how long the others may take to end their cell before they are abandoned
INTERRUPT_WAIT_SECONDS = 1.0  # after the person's interrupt, how long every rank may take to end its cell before the autopsy
# after Abandon, how long the ranks may take to end their cell (the error waits for it, only when one does not): 1.5 s
# was missed on a loaded 2-core machine (CI beside other tests), and every rank's state was lost for it
FAILURE_INTERRUPT_SECONDS = 5.0
STEP_SECONDS = 0.02
ALIVE_RECHECK_SECONDS = 0.05  # kept ranks seen alive this recently are not polled again (KeptGroup.running)
NOT_REPLACED = "no new process could take the dead rank's place"
KEPT_LINE = "taas: the ranks are kept, with their globals and their process group: the next --keep cell runs in them"


def replaced_line(dead: tuple[int, ...]) -> str:
    ranks = ", ".join(map(str, dead))
    return (f"taas: the other ranks are kept, with their globals and their process group: the next --keep cell starts "
            f"a new rank {ranks} in its place (what it held is gone)")


def lost_line(why: str) -> str:
    return f"taas: {why}: every rank was stopped and their state is lost; the next --keep cell starts new ranks"


@dataclass
class KeptGroup:
    """Kept ranks as supervision sees them: their processes and the selector watching them, once started."""

    group: ProcessGroup | None = None
    mux: Mux | None = None
    lost: str | None = None  # why they are gone (their state with them), once they are
    seen_alive_at: float = float("-inf")  # when every rank was last seen alive (:attr:`running`)
    replaces: bool = False  # a rank that dies is replaced while the others live on (on CPU: replacement.py)
    held: dict[int, CellDone] = field(default_factory=dict)  # each rank's last end of a cell: the names it holds
    pending: Pending | None = None  # ranks that died, whose new processes the next cell starts
    replaced: list[str] = field(default_factory=list)  # what was said of each replaced rank, with when (%taas status)

    def ended_why(self) -> str | None:
        """Why ranks that were started no longer run (a cell stopped them, a rank died), or None."""
        if self.lost is not None or self.group is None:
            return self.lost
        return replacement.why_dead(self.dead()) or None

    def dead(self) -> dict[int, int]:
        """Each dead rank's exit code (none: every rank lives, or none was started)."""
        return replacement.dead_ranks(self.group) if self.group is not None else {}

    def lives(self) -> bool:
        """Every rank alive, or those that died will be replaced (:attr:`replaces`; not rank 0)."""
        assert self.group is not None
        dead = self.dead()
        return not dead or self.replaces and replacement.replaceable(dead, len(self.group.children))

    @property
    def running(self) -> bool:
        """Started, and every rank still alive or to be replaced (a rank may die between cells: the next cell
        starts a new one, or new ranks where it cannot).
        A cell's plan asks several times within a few milliseconds; their processes are polled at most once in
        :data:`ALIVE_RECHECK_SECONDS` (a rank that dies meanwhile fails the cell as any dying rank does)."""
        if self.group is None or self.lost is not None:
            return False
        now = time.monotonic()
        if now - self.seen_alive_at > ALIVE_RECHECK_SECONDS:
            if not self.lives():
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

    def __init__(self, ranks: KeptGroup, start: Callable[[int], ProcessGroup], run_id: str, replace: ReplaceRank):
        self.ranks, self._start, self._replace, self.run_id = ranks, start, replace, run_id
        self.fresh = not ranks.running
        self.kept = False  # whether the ranks outlive the cell (its attempt said so)
        self._readmit: Callable[[list[int]], None] = _nothing_readmitted

    def mux(self, parts: RunParts) -> Mux:
        """The kept ranks' selector, its peers and frames this cell's, and the cell sent to each rank now, the
        run's first step (they begin it while its supervision is made); new ranks' new selector. Ranks that died
        since the last cell: the others are told (replacement.py), and their new processes get the cell as they
        connect."""
        ranks = self.ranks
        if self.fresh:
            ranks.close()  # a group whose rank died between cells: what is left of it
            ranks.lost, ranks.pending = None, None
            parts.server.readmit(range(parts.ids.ranks))  # the new ranks prove the same key on the same listener
            ranks.mux = Mux(parts.server, parts.ids, parts.greeting)
        else:
            assert ranks.mux is not None and ranks.group is not None
            ranks.mux.channels.ids, ranks.mux.channels.greeting = parts.ids, parts.greeting
            self._readmit = parts.server.readmit
            dead = ranks.dead() if ranks.lives() else {}  # (a death that cannot be replaced fails the cell)
            if dead and (ranks.pending is None or set(ranks.pending.ranks) != set(dead)):  # died since the last cell
                ranks.pending = replacement.tell_survivors(ranks.group, ranks.mux.send, dead, ranks.held,
                                                           f"{self.run_id}-replaced", replacement.why_dead(dead))
            for rank in range(len(ranks.group.children)):
                if rank not in dead:
                    for body in parts.greeting(Peer(RANK, rank)):
                        ranks.mux.send(Peer(RANK, rank), body)
        parts.server.readmit(range(parts.ids.ranks, len(parts.ids)))  # this cell's data workers, as the last cell's
        return ranks.mux

    def start(self, supervisor: Supervised, attempt: int) -> ProcessGroup:
        """New ranks after their displays; running ones had the cell (:meth:`mux`), then its displays go out: their
        output is read only after them, so it comes below them. A dead rank's new process starts here, and the
        header says what went with the dead one."""
        assert not attempt, "a kept cell has one attempt"
        supervisor.show_start()
        if self.fresh:
            self.ranks.group = self._start(0)
        elif self.ranks.pending is not None:
            self._replace_dead(supervisor, self.ranks.pending)
        assert self.ranks.group is not None and self.ranks.mux is not None
        return FramedInterrupts(self.ranks.group, self.ranks.mux, self.run_id)

    def _replace_dead(self, supervisor: Supervised, pending: Pending) -> None:
        ranks, mux = self.ranks, self.ranks.mux
        assert mux is not None

        def forget(rank: int) -> None:
            mux.forget(lambda peer: peer == Peer(RANK, rank))
            self._readmit([rank])

        try:
            lines = replacement.replace(pending, ranks.held, forget, self._replace)
        except Exception as exc:  # an engine's own too (a Ray host's agent gone): said, the ranks lost
            said = str(exc) if isinstance(exc, LaunchError) else f"taas: {type(exc).__name__}: {exc}"
            raise LaunchError(f"{said}\n{lost_line(NOT_REPLACED)}") from exc
        ranks.pending = None
        stamp = time.strftime("%H:%M:%S")
        for line in lines:
            supervisor.relay.notice(line)
            ranks.replaced.append(f"{line.removeprefix('taas: ')} (at {stamp})")

    def running(self, attempt: int) -> Callable[[], None]:
        return _nothing

    def interrupted(self, supervisor: Supervised, group: ProcessGroup) -> bool:
        """Every rank interrupted; where those that did not stop are (the autopsy: in C code or a collective), then
        every rank's collectives abandoned (:func:`_abandon_every_rank`)."""
        group.interrupt(supervisor.verdict.running())
        if not _wait_for_every_cell(supervisor, self.ranks, INTERRUPT_WAIT_SECONDS):
            supervisor.explain_stop()
        kept = _abandon_every_rank(supervisor, self.ranks, self.run_id, "the cell was interrupted")
        supervisor.relay.notice(KEPT_LINE if kept else lost_line("a rank did not stop in time (in C code)"))
        return kept

    def failed(self, supervisor: Supervised, group: ProcessGroup, attempt: int, previous: RunError | None) -> Judged:
        """Said at once, as a fact (the others' time takes seconds); then the others may end their cell (they all
        raised), and every rank's collectives are abandoned: a rank still in its cell is interrupted, one in a
        collective leaves it, and the ranks are kept. Ranks that died are replaced in the next cell, where they
        can be (:attr:`KeptGroup.replaces`)."""
        verdict = supervisor.verdict
        assert verdict.failure is not None, "only a failed attempt is judged"
        summary = str(verdict.failure).splitlines()[0]
        supervisor.relay.notice(f"taas: {summary}")
        dead = self.ranks.dead()  # (the others wait for it in their collectives, held until Abandon: no wait)
        if not isinstance(verdict.failure, RunTimeout) and not dead:
            _wait_for_every_cell(supervisor, self.ranks, KEEP_WAIT_SECONDS)
        dead = self.ranks.dead()
        if dead and self.ranks.lives():
            assert self.ranks.group is not None and self.ranks.mux is not None  # dead ranks: started ones
            self.ranks.pending = replacement.tell_survivors(self.ranks.group, self.ranks.mux.send, dead,
                                                            self.ranks.held, self.run_id, summary)
            kept = _wait_for_every_cell(supervisor, self.ranks, FAILURE_INTERRUPT_SECONDS)
            kept_line, why = replaced_line(tuple(dead)), "the other ranks did not end their cell after the failure in time"
        else:
            kept = _abandon_every_rank(supervisor, self.ranks, self.run_id, summary)
            kept_line, why = KEPT_LINE, _why_lost(dead)
        failure = supervisor.last_words((kept_line,) if kept else (lost_line(why),))
        return Judged(failure.on_kept_ranks() if kept and isinstance(failure, (PeerFailed, RunTimeout)) else failure,
                      outlived=kept)

    def attempt_over(self, supervisor: Supervised, group: ProcessGroup, outlived: bool) -> None:
        """Ranks that do not outlive the cell: TERM, then KILL (they had their SIGINT, or their time to end it)."""
        self.kept = outlived
        self.ranks.held.update(supervisor.verdict.held)
        if not outlived:
            supervisor.stop_everything(group, graceful=False)

    def close(self) -> None:
        """The cell's data workers forgotten (stopped with it), the ranks watched on; or, lost, closed."""
        mux = self.ranks.mux
        if mux is not None:
            mux.channels.greeting = _no_greeting  # the mux outlives the cell: not its frames
        if self.kept and mux is not None:
            mux.forget(_not_a_rank)
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

    def replace(self, rank: int, plan: LaunchPlan) -> ChildProcess:
        return self.group.replace(rank, plan)

    def close(self) -> None:
        """Nothing: kept ranks outlive their cell's attempt (:meth:`Keeping.close` decides)."""

    def __enter__(self) -> FramedInterrupts:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()


def _abandon_every_rank(supervisor: Supervised, ranks: KeptGroup, run_id: str, why: str) -> bool:
    """``Abandon`` to every rank (rank/betweencells.py: interrupted if still in the cell, every collective ended, the
    groups renewed before the next cell); whether each ended its cell within :data:`FAILURE_INTERRUPT_SECONDS`."""
    if ranks.group is None or ranks.mux is None:
        return False  # never started, or closed: nothing to keep
    frame = protocol.encode(protocol.Abandon(run_id, why))
    for rank in range(len(ranks.group.children)):
        ranks.mux.send(Peer(RANK, rank), frame)
    return _wait_for_every_cell(supervisor, ranks, FAILURE_INTERRUPT_SECONDS)


def _nothing() -> None:
    return None


def _not_a_rank(peer: Peer) -> bool:
    return not peer.is_rank  # a kept cell's data worker, stopped with it


def _nothing_readmitted(ranks: list[int]) -> None:
    return None


def _why_lost(dead: dict[int, int]) -> str:
    if dead:
        return f"{replacement.why_dead(dead)}, and a dead rank is replaced only among CPU ranks (gloo)"
    return "not every rank ended its cell after the failure, even interrupted"


def _no_greeting(peer: Peer) -> list[bytes]:
    return []


def _wait_for_every_cell(supervisor: Supervised, ranks: KeptGroup, seconds: float) -> bool:
    """Whether every rank ended its cell (said CellDone) within ``seconds``, and is alive."""
    deadline = time.monotonic() + seconds
    verdict = supervisor.verdict
    while not verdict.ranks_exited() and time.monotonic() < deadline:
        supervisor.pump(STEP_SECONDS)
    return verdict.ranks_exited() and ranks.group is not None and ranks.lives()
