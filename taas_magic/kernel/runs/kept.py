"""Kept ranks (``--keep``): what the session holds between cells so the next cell runs in the same ranks.

Runs in the kernel: made and looked up on the cell's thread (the plan step, kernel/runs/runplan.py), used
by each kept cell's run on its thread (kernel/supervision/keptcell.py), released on the cell's thread
(``%taas release``, a ``--keep`` cell of another shape, unloading the extension).

A plain run makes its rank server, its write-rule layers and its stacks folder, and gives them back when
its ranks are gone. :class:`KeptRanks` holds those for as long as the ranks are kept, with the backend (a
reserved port; the GPUs it placed the ranks on) and :class:`KeptGroup` (the processes, and the selector
watching them). A kept cell's run borrows them and releases only its own parts (its log, its closure's
files, its checkpoints' check). The ranks' owner tag is the kept ranks', so a cell's end sweeps nothing of
theirs; releasing them ends the ranks (their channels closed: they leave on their own; the stop ladder for
the rest), then sweeps what they started, then gives the port and the GPUs back.

Names travel only when needed (:class:`NameTokens`): the ranks have every notebook value a cell that
succeeded sent them, and rank 0's values that came back are the ranks' own. A name the cell reads is sent
only when the notebook bound another object to it since; so rank 1's ``w`` is never overwritten by the
notebook's copy of rank 0's ``w``. It follows that a name only rank 0 bound is not sent to the other ranks
(they never had it: bind it on every rank, or rebind it in the notebook), and that a value changed in place
in the notebook (``cfg["lr"] = 0.1``) is not sent again: rebind it. A value that takes no weak reference (a
list, a dict) is held by the tokens until its name is rebound or the ranks are released.
"""

from __future__ import annotations

import os
import secrets
import time
import weakref
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from taas_magic import wire
from taas_magic.autopsy import stacks
from taas_magic.cell.options import MAX_CPUS
from taas_magic.kernel.supervision.keptcell import KeptGroup
from taas_magic.kernel.supervision.server import PeerServer
from taas_magic.launch.contract import Backend
from taas_magic.peers import PeerIds
from taas_magic.procs import kill_tagged
from taas_magic.protocol import Result
from taas_magic.tempdirs import remove_tree
from taas_magic.transfer import keptnames
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


class KeptRanks:
    """Ranks kept for the cells of one shape (see the module docstring); whole once made, released once."""

    def __init__(self, shape: Shape, backend: Backend):
        """Enter ``backend`` and take the ranks' server, layers and stacks folder; the ranks start with the
        first cell. A part that cannot be taken releases the ones before it and raises."""
        self.shape, self.id = shape, secrets.token_hex(4)
        self.names = NameTokens()
        self.cells = 0  # cells run on them since they started
        self.started = time.time()
        self.busy_with: str | None = None  # the id of the run using them now
        self.fetch: Callable[[KeptRanks, str], object] | None = None  # copies a name from rank 0 (the magic's)
        self.health: dict[int, dict] = {}  # each rank's figures (rss, gpu_memory) at the end of its last cell
        self._reported: set[str] = set()  # the write rule's lines already said
        self._stack = ExitStack()
        try:
            self.backend = self._stack.enter_context(backend)
            self._stack.callback(self._gone)
            self.peers = PeerIds(len(self.backend.slots))
            self.stacks_dir = stacks.make_dir(f"keep{self.id}")
            self._stack.callback(remove_tree, self.stacks_dir)
            self.layers = ScratchLayers(self.peers.ranks)
            self._stack.callback(self.layers.remove)
            # the ranks, and each cell's data workers after them (peers.py numbers them so)
            self.server = PeerServer(wire.new_key(), len(self.peers) + MAX_CPUS, self.backend.listen_host)
            self._stack.callback(self.server.close)
            self.ranks = KeptGroup()
            self._stack.callback(self.ranks.close)
        except BaseException:
            self._stack.close()
            raise

    @property
    def owner(self) -> str:
        """The ``TAAS_OWNER`` tag of the kept ranks and of what they start (never a cell's: a cell sweeps its own)."""
        return f"{os.getpid()}-keep{self.id}-ranks"

    @property
    def running(self) -> bool:
        return self.ranks.running

    @property
    def holds_local_gpus(self) -> bool:
        """Running on this host's GPUs (which a plain cell must not be placed on meanwhile)."""
        return self.running and self.shape.cluster == 0 and self.backend.devices.device == "cuda"

    def cell_bound(self, sent: Mapping[str, object], result: Result | None, namespace: dict) -> None:
        """A cell on them succeeded, its results bound: the names rank 0 left on the ranks bound as proxies
        (transfer/keptnames.py), and what the ranks have now noted."""
        if result is not None and result.kept_back and self.fetch is not None:
            keptnames.bind(namespace, result.kept_back, self, self.fetch)
        self.names.cell_ran(sent, result, namespace)

    def cell_over(self) -> None:
        """A cell's run on them ended (its parts released)."""
        self.busy_with = None
        self.cells += 1

    def new_lines(self, lines: list[str]) -> list[str]:
        """Of the write rule's report after a cell, the lines not said after an earlier cell."""
        fresh = [line for line in lines if line not in self._reported]
        self._reported.update(fresh)
        return fresh

    def status_lines(self) -> list[str]:
        """What ``%taas status`` says of them: shape, cells, and each rank's memory at the end of its last cell."""
        if not self.running:
            return [f"kept ranks: none running ({self.shape}; {self.ranks.ended_why() or 'not started'})"]
        idle = "busy with run " + self.busy_with if self.busy_with else "idle"
        since = time.strftime("%H:%M:%S", time.localtime(self.started))
        lines = [f"kept ranks: {self.shape}, {self.cells} cell(s) since {since}, {idle} (%taas release ends them)"]
        assert self.ranks.group is not None
        for child in self.ranks.group.children:
            figures = self.health.get(child.index, {})
            memory = [f"{figures['rss'] / 2**20:.0f} MiB host"] if "rss" in figures else []
            if "gpu_memory" in figures:
                memory.append(f"{figures['gpu_memory'] / 2**20:.0f} MiB on GPU {figures.get('gpu', '?')}")
            process = f"pid {figures['pid']} on {child.host}" if "pid" in figures else f"on {child.host}"
            lines.append(f"  rank {child.index}, {process} ({self.shape.device}): "
                         f"{', '.join(memory) or 'memory not reported yet'}")
        return lines

    def release(self) -> None:
        """End the ranks and give back everything they held; a second call does nothing."""
        self._stack.close()

    def _gone(self) -> None:
        kill_tagged(f"{os.getpid()}-keep{self.id}-")  # what the ranks started and left
        self.backend.release()  # the spares start warming now
