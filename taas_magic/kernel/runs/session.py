"""The notebook session's state that ``%taas`` line commands set and every cell reads.

Runs in the kernel: set on the cell's thread by the magic and the line commands, read there and by
runs and searches on their own threads.

:class:`Session` holds the repository and the isolation (so the write rule), the warm
spares, the attached cluster (``$TAAS_CLUSTER``'s when the extension loads, if it answers),
the kept ranks (``--keep``), the compile cache's folder (compilecache/folder.py) and the last run,
for ``%taas status``. The magic (kernel/magic/magics.py) makes one when it is made, hands it to the
line commands (kernel/magic/commands.py) and closes it when it is unloaded; the session's settings
are not here: they are the magic's traitlets, so ``%config TaasMagics.x`` sets them.
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass, field
from typing import Callable

from taas_magic.cell.pragma import RunSettings
from taas_magic.compilecache.folder import CompileCache
from taas_magic.errors import ClusterError, LaunchError
from taas_magic.kernel.runs.background import Runs
from taas_magic.kernel.runs.rankset import SESSION, CellRunner, RankSet, Shape
from taas_magic.kernel.runs.summary import LastRun
from taas_magic.launch import engines
from taas_magic.launch.contract import Attachment, Backend, GpuSlice, Spares
from taas_magic.launch.rankenv import visible_gpu_count
from taas_magic.transfer import keptnames
from taas_magic.writes.rule import WriteRule, choose_rule, find_repository, probe_overlay_soon


@dataclass
class Session:
    """What ``%taas config``, ``warm`` and ``cluster`` changed, and what the last cell left."""

    spares: Spares = field(default_factory=engines.warm_spares)
    repository: str | None = None  # %taas config repo PATH
    isolation: str = "auto"  # %taas config isolation auto|overlay|python (overlay: refused where unavailable)
    cluster: Attachment | None = None  # %taas cluster ADDRESS|slurm, or $TAAS_CLUSTER at load
    last_run: LastRun | None = None
    runs: Runs = field(default_factory=Runs)  # this kernel's runs, running and done (kernel/runs/background.py)
    kept: RankSet | None = None  # --keep's ranks, between and during their cells (kernel/runs/rankset.py)
    compile_cache: CompileCache = field(default_factory=CompileCache)  # its folder made by the first cell that uses it
    runner: CellRunner | None = None  # the magic: kept ranks run the cell that copies a name from rank 0
    namespace: dict | None = None  # the notebook's: its names still on the kept ranks are copied before they end

    @classmethod
    def start(cls, warm: Warm) -> Session:
        """A new session: ``warm``'s spares warming (``auto``: the spare factory importing), attached
        to ``$TAAS_CLUSTER`` if it is set."""
        session = cls()
        probe_overlay_soon()  # the write rule's probe, off the first cell's path
        if warm.count is not None:
            session.spares.keep(warm.count)
        try:
            session.cluster = engines.attach(None)  # $TAAS_CLUSTER's, if it is set
        except ClusterError as exc:  # the extension still loads: the local mode works
            print(f"{exc} (${engines.ENVIRONMENT}); cells run as local processes", file=sys.stderr)
        if warm.count is None and not warm.off and session.cluster is None:
            session.spares.prepare()  # the first cell's ranks are forks, not fresh interpreters
        return session

    def backend(self, settings: RunSettings, warm: Warm, slot: int | None = None, slots: int = 1) -> Backend:
        """Where a run's ranks go: the attached cluster, or this host (``warm``'s spares); a search's trial on ``slot``
        of ``slots`` on GPUs gets its own slice of them. The one place that chooses a backend."""
        if self.cluster is not None:
            return self.cluster.place(settings.gpus, settings.per_host, settings.place_timeout)
        side_by_side = slot is not None and slots > 1 and settings.device != "cpu" and visible_gpu_count() > 0
        return engines.local_backend(settings.gpus, None if warm.off else self.spares,
                                     lambda: warm.after(settings.gpus * slots), settings.device,
                                     GpuSlice(slot, slots) if side_by_side and slot is not None else None)

    def kept_for(self, shape: Shape, backend: Callable[[], Backend]) -> tuple[RankSet, str | None]:
        """The kept ranks for a ``--keep`` cell of ``shape``: those kept now if they have that shape, else new
        ones on ``backend()`` (the kept ones of another shape ended first); and the line that says so, if any.

        Raises:
            LaunchError: the kept ranks are running another cell (a detached one) now.
        """
        kept, line = self.kept, None
        if kept is not None and kept.busy_with is not None:
            raise LaunchError(f"taas: the kept ranks are running run {kept.busy_with} now: %taas wait {kept.busy_with} "
                              "first, or %taas stop it")
        if kept is not None and kept.shape != shape:
            line = f"the kept ranks ({kept.shape}) ended: this cell wants {shape}, so new ranks start"
            self.release_kept()
        if self.kept is None:
            kept = RankSet(shape, SESSION, secrets.token_hex(4))
            kept.hold(backend())
            self.kept, kept.runner = kept, self.runner
        return self.kept, line

    def release_kept(self, stopped: bool = False) -> str:
        """End the kept ranks (``%taas release``; ``stopped``: every run was stopped, unloading), and say what
        was released."""
        kept = self.kept
        if kept is None:
            return "taas: no ranks are kept"
        if kept.busy_with is not None and not stopped:
            raise LaunchError(f"taas: the kept ranks are running run {kept.busy_with}: %taas stop {kept.busy_with} first")
        if not stopped and self.namespace is not None:
            keptnames.fetch_waiting(self.namespace, kept)  # cells on them: what the notebook still names comes here
        self.kept = None
        kept.release()
        return f"taas: released the kept ranks ({kept.shape}, {kept.cells} cell(s))"

    def ranks_gone(self) -> None:
        """A cell's ranks on this host are gone: if they (or earlier ones) compiled, spares come with torch's
        compiler warmed from now on (launch/local/spares.py)."""
        if self.compile_cache.compiled():
            self.spares.compiles()

    def close(self) -> None:
        """Unloading: every run stopped, the kept ranks, the spares, the compile cache's folder and the cluster (a Slurm
        allocation this session made is given back) gone."""
        self.runs.close()
        self.release_kept(stopped=True)
        self.spares.close(wait=5.0)
        self.compile_cache.close()
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            cluster.detach()

    def write_rule(self) -> WriteRule:
        """The write rule for a cell run now: the repository holding the working directory (or the
        one set), and the isolation set."""
        return choose_rule(find_repository(os.getcwd(), self.repository), self.isolation)


@dataclass(frozen=True)
class Warm:
    """``TaasMagics.warm`` and ``%taas warm``: ``off``, ``auto`` (after each cell, as many warm
    spares as its ranks) or N spares."""

    count: int | None  # N; None: auto (or off)
    off: bool = False

    @classmethod
    def parse(cls, text: str) -> "Warm":
        """Raises ValueError for anything but off, auto or a number."""
        if text == "off":
            return cls(None, off=True)
        if text == "auto":
            return cls(None)
        if text.isdigit():
            return cls(int(text))
        raise ValueError(text)

    def after(self, ranks: int) -> int:
        """The spares to keep after a cell of ``ranks`` ranks."""
        return 0 if self.off else self.count if self.count is not None else ranks
