"""A rank set: the ranks a run runs in, what they hold, and how long they live (one cell, or the session's ``--keep``).

Runs in the kernel: made on the cell's thread (the plan step, kernel/runs/runplan.py: a run's own, or the session's
kept ones, kernel/runs/session.py), borrowed by each run on its thread (kernel/runs/run.py; supervised by the one loop
of kernel/supervision/attempts.py under its lifetime's policy), released on the cell's thread (the run's end for one
cell's ranks; ``%taas release``, a ``--keep`` cell of another shape, unloading the extension for the session's).

A :class:`RankSet` holds, from :meth:`RankSet.hold` on, the backend (a reserved port; the GPUs or the cluster's places
it put the ranks on), the rank server, the write rule's layers, the stacks folder; and the owner tag, :class:`KeptGroup`
(the processes and the selector watching them, kept ones), the names sent to them (:class:`NameTokens`) and where it
is in its life (:class:`RankState`). A run borrows one (:meth:`RankSet.lend`) and releases only its own parts (its
log, its closure's files, its checkpoints' check); the differences between one cell's ranks and kept ones are the
set's :class:`Lifetime`, a policy: :data:`ONE_CELL` gives everything back as the cell's ranks are gone (the run's end
releases the set) and supervises them by restart-on-failure; :data:`SESSION` keeps it (their owner tag is theirs,
so a cell's end sweeps nothing of theirs; their layers stay, and the write rule's report says only what is new) and
supervises them by keep-on-failure. Releasing a set ends its ranks (their channels closed: kept ones leave on their
own; the stop ladder for the rest), then sweeps what they started, then gives the port and the GPUs back.

Names travel only when needed (:class:`NameTokens`): the ranks have every notebook value a cell that
succeeded sent them, and rank 0's values that came back are the ranks' own. A name the cell reads is sent
only when the notebook bound another object to it since; so rank 1's ``w`` is never overwritten by the
notebook's copy of rank 0's ``w``. It follows that a name only rank 0 bound is not sent to the other ranks
(they never had it: bind it on every rank, or rebind it in the notebook), and that a value changed in place
in the notebook (``cfg["lr"] = 0.1``) is not sent again: rebind it. A value that takes no weak reference (a
list, a dict) is held by the tokens until its name is rebound or the ranks are released.
"""

from __future__ import annotations

import enum
import os
import time
import weakref
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Protocol

from taas_magic import wire
from taas_magic.autopsy import stacks
from taas_magic.cell.options import MAX_CPUS
from taas_magic.kernel.supervision.attempts import Policy
from taas_magic.kernel.supervision.keptcell import Keeping, KeptGroup
from taas_magic.kernel.supervision.replacement import ReplaceRank
from taas_magic.kernel.supervision.restarts import Attempts, Restarting
from taas_magic.kernel.supervision.server import PeerServer
from taas_magic.launch.contract import Backend, ProcessGroup
from taas_magic.peers import PeerIds
from taas_magic.procs import kill_tagged
from taas_magic.tempdirs import remove_tree
from taas_magic.transfer import keptnames
from taas_magic.transfer.returns import Result
from taas_magic.writes.rule import ScratchLayers


@dataclass(frozen=True)
class Shape:
    """What a kept cell must match to run in the kept ranks: their count, device, placement, where they run."""

    ranks: int
    device: str
    where: str = field(compare=False)  # said: "this host", or the attached cluster ("Ray at HOST:PORT", "Slurm job N")
    cluster: int = 0  # which attachment (its id; 0: this host): what is compared, not its words
    per_host: int | None = None  # --per-host on a cluster

    def __str__(self) -> str:
        return f"{self.ranks} rank(s) on {self.device}, {self.where}"


class NameTokens:
    """Which notebook objects the kept ranks already have, by name (see the module docstring)."""

    def __init__(self) -> None:
        self._have: dict[str, Callable[[], object]] = {}

    def unsent(self, closure: Mapping[str, object]) -> dict[str, object]:
        """The names of ``closure`` the ranks do not have as they are: bound since they were sent, or never sent."""
        return {name: value for name, value in closure.items() if not self.has(name, value)}

    def has(self, name: str, value: object) -> bool:
        reference = self._have.get(name)
        return reference is not None and reference() is value

    def remember(self, names: Mapping[str, object]) -> None:
        """The ranks have these notebook objects now (sent to them, or bound from rank 0's)."""
        for name, value in names.items():
            self._have[name] = _reference(value)

    def forget(self, names: Iterable[str]) -> None:
        for name in names:
            self._have.pop(name, None)

    def cell_ran(self, sent: Mapping[str, object], result: Result | None, namespace: Mapping[str, object]) -> None:
        """A cell succeeded: the ranks have what it ``sent``, and rank 0's names just bound in ``namespace`` are theirs."""
        self.remember(sent)
        if result is not None:
            self.remember({segment.name: namespace[segment.name] for segment in result.segments
                           if segment.bind and segment.name in namespace})
            self.remember({name: namespace[name] for name, _, _ in result.kept_back if name in namespace})  # proxies
            self.forget(result.deleted)


def _reference(value: object) -> Callable[[], object]:
    """A weak reference where the value takes one (a model, a tensor), else the value itself (a list, a dict)."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


class Lifetime(Protocol):
    """How long a rank set lives, as a policy: what it does when a cell's run on it ends. The two are
    :data:`ONE_CELL` (fresh ranks) and :data:`SESSION` (``--keep``); only they ask which one a set has."""

    fate: str  # what became of a rank's diverted writes, in the write rule's report

    def tag(self, name: str) -> str:
        """What names the set's owner tag and stacks folder, from its ``name``."""

    def peers_beyond_ranks(self, workers: int) -> int:
        """How many data workers its rank server admits besides the ranks."""

    def cell_gone(self, ranks: "RankSet", run_id: str, workers: int) -> None:
        """A cell's ranks (and its ``workers``) are gone, its run not yet released."""

    def new_lines(self, ranks: "RankSet", lines: list[str]) -> list[str]:
        """Of the write rule's report after a cell, the lines to say."""

    def policy(self, ranks: "RankSet", start: Callable[[int], ProcessGroup], attempts: Attempts, run_id: str,
               replace: ReplaceRank) -> Policy:
        """What a failure costs run ``run_id``'s ranks (kernel/supervision/attempts.py), each attempt's from ``start``
        (``replace``: a new process in a dead rank's place, for kept ranks that outlive one)."""

    def lent(self, ranks: "RankSet", releases: ExitStack) -> None:
        """A run borrows the set: what the run's ``releases`` (its plan step's, then its own) do with it."""


class _OneCell:
    fate = "diverted and discarded"

    def tag(self, name: str) -> str:
        return name  # the run's id: the run's sweep is its ranks'

    def peers_beyond_ranks(self, workers: int) -> int:
        return workers

    def cell_gone(self, ranks: "RankSet", run_id: str, workers: int) -> None:
        ranks.give_back()  # no rank is left: the spares start warming now, not after the clean-up

    def new_lines(self, ranks: "RankSet", lines: list[str]) -> list[str]:
        return lines

    def policy(self, ranks: "RankSet", start: Callable[[int], ProcessGroup], attempts: Attempts, run_id: str,
               replace: ReplaceRank) -> Policy:
        return Restarting(start, attempts)  # --restarts: new ranks for each attempt

    def lent(self, ranks: "RankSet", releases: ExitStack) -> None:
        releases.callback(ranks.release)  # the run's own: released with it


class _Session:
    fate = "diverted, kept in its layer until %taas release"

    def tag(self, name: str) -> str:
        return f"keep{name}"  # never a cell's: a cell's sweep spares them

    def peers_beyond_ranks(self, workers: int) -> int:
        return MAX_CPUS  # each cell's data workers after the ranks (peers.py numbers them so)

    def cell_gone(self, ranks: "RankSet", run_id: str, workers: int) -> None:
        if workers:  # the ranks tag what they start as theirs, not the cell's: only its data workers' go
            kill_tagged(f"{os.getpid()}-{run_id}-")

    def new_lines(self, ranks: "RankSet", lines: list[str]) -> list[str]:
        fresh = [line for line in lines if line not in ranks.reported]
        ranks.reported.update(fresh)
        return fresh

    def policy(self, ranks: "RankSet", start: Callable[[int], ProcessGroup], attempts: Attempts, run_id: str,
               replace: ReplaceRank) -> Policy:
        # a dead rank is replaced where the group's abort is taas's (gloo) and the engine starts one rank in place
        ranks.ranks.replaces = ranks.backend.devices.device != "cuda" and ranks.backend.replaces_ranks
        return Keeping(ranks.ranks, start, run_id, replace)  # the ranks outlive the cell (--restarts with --keep is refused)

    def lent(self, ranks: "RankSet", releases: ExitStack) -> None:
        return None  # the session's: released by %taas release, another shape, or unloading


ONE_CELL: Lifetime = _OneCell()
SESSION: Lifetime = _Session()


class CellRunner(Protocol):
    """Runs a ``%%taas`` cell as the notebook's own would run, and gives its final value (the magic,
    kernel/magic/magics.py): how a rank set fetches a name left on rank 0 (:meth:`RankSet.fetch`)."""

    def run_cell(self, cell: str) -> object: ...


def kept_pragma(shape: Shape) -> str:
    """The pragma line of a cell the kernel runs on kept ranks of ``shape``."""
    per_host = f" --per-host {shape.per_host}" if shape.per_host else ""
    return f"#pragma taas --keep --gpus {shape.ranks} --device {shape.device}{per_host}\n"


def fetch_cell(shape: Shape, name: str) -> str:
    """The kept cell that copies ``name`` from rank 0: run on kept ranks of ``shape``, its last line the name."""
    return f"{kept_pragma(shape)}globals().get({name!r})\n"


def heal_cell(shape: Shape, source: int, names: tuple[str, ...]) -> str:
    """The kept cell that copies rank ``source``'s ``names`` (none: all) into the ranks that lack them (rank/heal.py)."""
    return f"{kept_pragma(shape)}__import__('taas_magic.rank.heal', fromlist=['heal']).heal({source}, {names!r});\n"


class RankState(enum.Enum):
    """Where a rank set is in its life (as torch elastic's ``WorkerState`` is a worker group's)::

        NEW --a cell borrows it--> BUSY --the cell ends, the ranks live--> IDLE --a cell--> BUSY ...
                                   BUSY --a failure stopped them, or a rank died--> LOST --a cell: new ranks--> BUSY
        any --released--> RELEASED

    One cell's ranks go NEW, BUSY, RELEASED (their run releases the set as it ends)."""

    NEW = "new"  # made; no rank started yet
    BUSY = "busy"  # a cell runs on it
    IDLE = "idle"  # its ranks run, between cells (kept ranks)
    LOST = "lost"  # its ranks were stopped or died, their state with them; the next cell starts new ones
    RELEASED = "released"  # given back: nothing of it is left


class RankSet:
    """The ranks one run, or the session's ``--keep`` cells, run in (see the module docstring): what they hold, and
    for how long (:class:`Lifetime`), and where they are in their life (:attr:`state`); whole once made, released
    once. A run always borrows one."""

    def __init__(self, shape: Shape, lifetime: Lifetime, name: str):
        """A set that holds nothing yet (:meth:`hold` takes its parts). ``name``: the run's id for :data:`ONE_CELL`
        (its owner tag and stacks folder are the run's), a new one for :data:`SESSION`."""
        self.shape, self.lifetime, self.id = shape, lifetime, name
        self.tag = lifetime.tag(name)  # names its owner tag and its stacks folder
        self.names = NameTokens()
        self.cells = 0  # cells run on them since they started
        self.started = time.time()
        self.busy_with: str | None = None  # the id of the run using them now
        self.runner: CellRunner | None = None  # runs the cell that fetches a name left on rank 0 (the magic)
        self.health: dict[int, dict] = {}  # each rank's figures (rss, gpu_memory) at the end of its last cell
        self.reported: set[str] = set()  # the write rule's lines already said (kept ranks)
        self.ranks = KeptGroup()  # their processes and the selector watching them, once started (kept ranks)
        self.held = self._given_back = self._released = False
        self._stack = ExitStack()
        self.backend: Backend  # the parts, from :meth:`hold` on
        self.peers: PeerIds
        self.stacks_dir: str
        self.layers: ScratchLayers
        self.server: PeerServer

    def hold(self, backend: Backend, workers: int = 0) -> None:
        """Enter ``backend`` and take the ranks' server, layers and stacks folder; the ranks start with the first
        cell. ``workers``: one cell's data workers. A part that cannot be taken releases the ones before it and
        raises."""
        stack = ExitStack()
        try:
            self.backend = stack.enter_context(backend)
            stack.callback(self.give_back)
            self.peers = PeerIds(len(self.backend.slots))
            self.stacks_dir = stacks.make_dir(self.tag)
            stack.callback(remove_tree, self.stacks_dir)
            self.layers = ScratchLayers(self.peers.ranks)
            stack.callback(self.layers.remove)
            self.server = PeerServer(wire.new_key(), len(self.peers) + self.lifetime.peers_beyond_ranks(workers),
                                     self.backend.listen_host)
            stack.callback(self.server.close)
        except BaseException:
            stack.close()
            raise
        self._stack.push(stack.pop_all())
        self._stack.callback(self.ranks.close)  # released first: the ranks end, then what they held goes
        self.held = True

    def lend(self, releases: ExitStack, backend: Callable[[], Backend], workers: int) -> None:
        """Lent to a run (the plan step's ``releases``): its parts taken now if it holds none yet (from ``backend()``,
        with room for the run's ``workers``), and what the run's end does with it, its lifetime's."""
        if not self.held:
            self.hold(backend(), workers)
        self.lifetime.lent(self, releases)

    def closure_for(self, closure: Mapping[str, object], registered: Iterable[object]) -> dict[str, object]:
        """Of a cell's ``closure``, what its ranks must be sent: running ranks lack only names the notebook bound
        since (:class:`NameTokens`; a registered loader is served anew, so it always goes); new ranks, all of it."""
        if not self.running:
            self.names = NameTokens()  # new ranks: they have nothing yet
            return dict(closure)
        loaders = {name for name, value in closure.items() if any(value is loader for loader in registered)}
        return {**self.names.unsent(closure), **{name: closure[name] for name in loaders}}

    @property
    def owner(self) -> str:
        """The ``TAAS_OWNER`` tag of the ranks and of what they start (kept ranks': never a cell's, which sweeps its own)."""
        return f"{os.getpid()}-{self.tag}-ranks"

    @property
    def state(self) -> RankState:
        """Where the set is in its life (:class:`RankState`); a rank that died between cells is seen here."""
        if self._released:
            return RankState.RELEASED
        if self.busy_with is not None:
            return RankState.BUSY
        if self.ranks.running:
            return RankState.IDLE
        return RankState.NEW if self.ranks.group is None and self.ranks.lost is None else RankState.LOST

    @property
    def running(self) -> bool:
        """Its ranks run (a cell on them, or between cells): polled, at most once in 50 ms (keptcell.py)."""
        return self.ranks.running

    @property
    def keeps_processes(self) -> bool:
        """It holds its ranks' processes past their cell: kept ones, started and not lost (not polled)."""
        return self.ranks.group is not None and self.ranks.lost is None

    # -- a name rank 0 kept (transfer/keptnames.py's KeptRanks) -------------------------------------------------
    @property
    def incarnation(self) -> object:
        """Which processes its ranks are (new ranks are another group)."""
        return self.ranks.group

    def ended_why(self) -> str:
        return self.ranks.ended_why() or "released"

    def fetch(self, name: str) -> object:
        """``name`` copied from rank 0: one kept cell on these ranks, its last line the name."""
        if self.runner is None:
            raise keptnames.KeptNameLost(f"taas: {name} stayed on rank 0 of the kept ranks, and nothing here runs cells")
        value = self.runner.run_cell(fetch_cell(self.shape, name))
        if value is None:
            raise keptnames.KeptNameLost(f"taas: rank 0 of the kept ranks no longer has {name}")
        return value

    def noted(self, name: str, value: object) -> None:
        self.names.remember({name: value})

    @property
    def holds_local_gpus(self) -> bool:
        """Running on this host's GPUs (which a plain cell must not be placed on meanwhile)."""
        return self.running and self.shape.cluster == 0 and self.backend.devices.device == "cuda"

    def cell_bound(self, sent: Mapping[str, object], result: Result | None, namespace: dict) -> None:
        """A cell on them succeeded, its results bound: the names rank 0 left on the ranks bound as proxies
        (transfer/keptnames.py), and what the ranks have now noted."""
        if result is not None and result.kept_back:
            keptnames.bind(namespace, result.kept_back, self)
        self.names.cell_ran(sent, result, namespace)

    def cell_over(self) -> None:
        """A cell's run on them ended (its parts released)."""
        self.busy_with = None
        self.cells += 1

    def new_lines(self, lines: list[str]) -> list[str]:
        """Of the write rule's report after a cell, the lines to say (kept ranks: those not said after an earlier cell)."""
        return self.lifetime.new_lines(self, lines)

    def cell_gone(self, run_id: str, workers: int) -> None:
        """Run ``run_id``'s ranks (and its ``workers``) are gone: what their lifetime does then."""
        self.lifetime.cell_gone(self, run_id, workers)

    def release(self) -> None:
        """End the ranks and give back everything they held; a second call does nothing."""
        self._stack.close()
        self._released = True

    def give_back(self) -> None:
        """What the ranks started and left swept, and the backend's placement given back (the spares start warming
        now); once."""
        if not self._given_back:
            self._given_back = True
            kill_tagged(f"{os.getpid()}-{self.tag}-")
            self.backend.release()
