"""``%%taas`` and ``%taas``: orchestration only (parse -> plan -> run -> render).

Runs in the kernel, on the cell's thread (the kernel's main thread): it plans a run and waits for it
there, while the run goes on its own thread (kernel/runs/background.py).

Session defaults are traitlets, so ``%config TaasMagics.output = 'all'`` and
``ipython_config.py`` work (kernel/magic/settings.py makes them from the option table);
cell/prepared.py's ``prepare`` (``pragma.settle``) decides each run's settings once, a pragma option always winning over a
default. The plan step (kernel/runs/runplan.py) builds the run object (kernel/runs/run.py), which holds
every part of the run and releases all of them, in reverse order, however the cell ends; the
run step (kernel/runs/execution.py) starts and supervises its ranks on the run's own thread
(kernel/runs/background.py) while the cell shows its log and waits (kernel/runs/foreground.py), or
returns at once (``--detach``). The session's ``backend`` (kernel/runs/session.py) is the one place that
chooses a backend (local processes or the attached cluster).

The session's state (kernel/runs/session.py: repository, isolation, warm spares, cluster, last
run) is the magic's ``session``; ``%taas`` line commands (kernel/magic/commands.py's table) change it and
are given the traitlets they read or set, never the magic.
"""

from __future__ import annotations

import functools
from typing import Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from traitlets import Bool, Int, Unicode, validate

from taas_magic.cell.options import SETTINGS
from taas_magic.cell.pragma import PragmaOptions
from taas_magic.cell.prepared import prepare
from taas_magic.errors import RunInterrupted
from taas_magic.kernel.magic import commands
from taas_magic.kernel.magic.debug import no_ipython_post_mortem
from taas_magic.kernel.magic.linecommands import MagicSettings
from taas_magic.kernel.magic.settings import VALIDATED, option_trait, refuse
from taas_magic.kernel.runs.background import BackgroundRun, RunThread, give_back_memory
from taas_magic.kernel.runs.foreground import STOP, open_console, wait_async, wait_blocking
from taas_magic.kernel.runs.runplan import PlanContext, plan
from taas_magic.kernel.runs.session import Session, Warm
from taas_magic.kernel.runs.views import Started, Viewing, show_run, start_shown
from taas_magic.kernel.trials.searchplan import plan_search
from taas_magic.launch.contract import Spares
from taas_magic.launch.rankenv import RankChoice, choose_ranks, visible_gpu_count
from taas_magic.output.budget import HEAD_BYTES, HEAD_LINES, TAIL_LINES, OutputBudget
from taas_magic.output.frontend import Frontend
from taas_magic.transfer import keptnames
from taas_magic.transfer.handoff import HANDOFF_BYTES
from taas_magic.writes.checkpoints import DEFAULT_KEEP


@magics_class
class TaasMagics(Magics):
    output = option_trait("--output", "Default for --output.")
    timeout = option_trait("--timeout", "Default for --timeout, in seconds.")
    hang = option_trait("--hang", "Default for --hang: seconds in one collective before the cell says so (0: never).")
    cache_ram = option_trait("--cache-ram", "Default for --cache-ram (e.g. '4G'); empty: min(4G, half of /dev/shm free).")
    ahead = option_trait("--ahead", "Default for --ahead: elements per rank that may wait before workers pause.")
    place_timeout = option_trait("--place-timeout", "Default for --place-timeout: seconds to wait for a cluster's GPUs.")
    restarts = option_trait("--restarts", "Default for --restarts: times a failed run starts again within its cell.")
    keep = option_trait("--keep", "Default for --keep: True keeps every cell's ranks for the next cell (%taas release).")
    max_output_lines = Int(HEAD_LINES, config=True, help="Lines of rank output a cell shows before the rest goes to a log file.")
    max_output_bytes = Int(HEAD_BYTES, config=True, help="Bytes of rank output a cell shows before the rest goes to a log file.")
    tail_output_lines = Int(TAIL_LINES, config=True, help="Last lines shown at the end of a cell whose output was elided.")
    closure_file_bytes = Int(HANDOFF_BYTES, config=True, help="Closures this large reach the ranks as one shared file.")
    warm = Unicode("auto", config=True, help="Warm spares: 'auto' (as many as the last cell's --gpus), 'off', or a number.")
    checkpoint_dir = Unicode("", config=True, help="Where taas.save_checkpoint writes, a folder per run; "
                             "empty: <repository>/.taas/checkpoints.")
    keep_checkpoints = Int(DEFAULT_KEEP, config=True,
                           help="Checkpoints kept per run, the newest; older ones go as new ones land.")
    compile_cache = Bool(True, config=True, help="Ranks on this host share a folder of the session for torch.compile's caches.")
    lazy_bytes = Int(keptnames.LAZY_BYTES, config=True, help="Kept cells' names this large stay on rank 0 till touched.")
    view = Unicode("auto", config=True, help="How a run is shown: 'widget' (a live view a reloaded page restores), "
                   "'stream' (the cell's output), 'auto' (the widget where the page restores widgets).")

    @validate(*VALIDATED)
    def _valid_setting(self, proposal: dict[str, Any]) -> object:
        return refuse(proposal["trait"].name, proposal["value"])

    def __init__(self, shell: InteractiveShell | None = None, **kwargs: Any) -> None:
        super().__init__(shell=shell, **kwargs)
        self.session = Session.start(self._warm)  # what %taas commands set and cells read (kernel/runs/session.py)
        self.session.runner, self.session.namespace = self, getattr(shell, "user_ns", None)  # the magic runs cells
        self.frontend = Frontend(shell)  # whether a page that restores widgets shows this kernel

    def close(self) -> None:
        """Unloading: the session closed (kernel/runs/session.py), then the widget probe."""
        self.session.close()
        self.frontend.close()

    @property
    def spares(self) -> Spares:
        """The warm spares (the extension closes them when it is unloaded)."""
        return self.session.spares

    @property
    def _warm(self) -> Warm:
        return Warm.parse(self.warm)  # validated when set

    @property
    def _shell(self) -> InteractiveShell:
        assert self.shell is not None, "TaasMagics is registered with a shell"
        return self.shell

    @cell_magic("taas")  # type: ignore[arg-type]  # IPython's decorator types are too narrow
    def taas_cell(self, line: str, cell: str) -> object:
        """Run this cell as N DDP ranks: ``%%taas --gpus N [...]`` (see ``%taas help``).

        Where the kernel runs cells as coroutines, the input transformer sends taas cells to
        :meth:`taas_cell_async` instead, so the kernel answers the page while the run lasts."""
        started = self._start(line, cell)
        if started.run.detached:
            return None
        wait_blocking(started.run, started.shown, STOP, started.console)
        return self._take(started.run)

    async def taas_cell_async(self, line: str, cell: str) -> object:
        """:meth:`taas_cell` as a coroutine (kernel/runs/foreground.py)."""
        started = self._start(line, cell)
        if started.run.detached:
            return None
        await wait_async(started.run, started.shown, STOP, started.console)
        return self._take(started.run)

    def run_cell(self, cell: str) -> object:
        """A ``%%taas`` cell run as the notebook's own (kernel/runs/rankset.py's ``CellRunner``: kept ranks fetch a
        name left on rank 0 so); its final value."""
        return self.taas_cell("", cell)

    def _take(self, run: RunThread) -> object:
        try:
            return run.take(self._shell.user_ns)
        except KeyboardInterrupt:  # every rank is stopped and the autopsy shown: one line, not our frames
            no_ipython_post_mortem(self._shell)
            raise RunInterrupted() from None
        except BaseException:
            no_ipython_post_mortem(self._shell)
            raise

    def _start(self, line: str, cell: str) -> Started:
        """Parse, plan (the header into the run's log), start the run's thread and its view."""
        prepared = prepare(self._shell, cell, line, self._session(), self._choose_ranks)
        settings, why, code, closure = prepared.settings, prepared.why, prepared.code, prepared.closure
        if not (settings.keep and self.session.kept is not None and self.session.kept.running):  # a kept cell's run
            give_back_memory()  # trims if it carries much; else what the notebook freed since (kernel/runs/background.py)
        if settings.trials is not None:  # a search: its trials are planned on its thread (kernel/trials/searchrun.py)
            search = self.session.runs.add(plan_search(settings, code, closure, why, self.session, self._context))
            search.start()
            return Started(search, show_run(search, self._viewing(search, widget=False)))
        run = plan(settings, code, closure, why, self._context())  # holds everything it took; its thread releases it
        background = self.session.runs.add(BackgroundRun(run, settings.detach))
        console = None if settings.detach else open_console(background)  # its prompts are this cell's from the start
        return Started(background, start_shown(background, self._viewing(background)), console)

    def _context(self, slot: int | None = None, slots: int = 1) -> PlanContext:
        """What planning a run reads; a search's trial on ``slot`` of ``slots`` is placed there."""
        backend = functools.partial(self.session.backend, warm=self._warm, slot=slot, slots=slots)
        return PlanContext(self.session, self._shell, backend, self.checkpoint_dir, self.keep_checkpoints,
                           self.closure_file_bytes, self.session.compile_cache.folder() if self.compile_cache else "",
                           self.lazy_bytes)

    def _viewing(self, run: RunThread, widget: bool = True) -> Viewing:
        """The view a run gets in this cell; a search's table is a display the widget would not draw: a stream."""
        budget = OutputBudget(run.id, self.max_output_lines, self.max_output_bytes, self.tail_output_lines)
        return Viewing(self._shell, widget and self.frontend.choose(self.view), budget)

    def _choose_ranks(self, options: PragmaOptions) -> RankChoice:
        """``--gpus`` made a number against this host's GPUs or the cluster's, before anything is held; and why that
        number, for the header."""
        cluster = self.session.cluster
        if cluster is None:
            return choose_ranks(options.gpus, options.device, visible_gpu_count)
        if options.device == "cpu":
            raise UsageError("taas: --device cpu runs the ranks on this host's CPU, but a cluster is attached "
                             "(its ranks run on its GPUs); %taas cluster local runs cells on this host again")
        return choose_ranks(options.gpus, options.device, lambda: sum(node.gpus_total for node in cluster.nodes()),
                            where="the cluster")

    def _session(self) -> dict[str, object]:
        """This session's value of every setting that is an option's default."""
        return {name: getattr(self, name) for name in SETTINGS}

    @line_magic("taas")  # type: ignore[arg-type]  # IPython's decorator types are too narrow
    def taas_line(self, line: str) -> object:
        """``%taas COMMAND``: the row of kernel/magic/commands.py's table the line names (``%taas help`` lists them)."""
        return commands.run(line, self.session, self.command_settings())

    def command_settings(self) -> MagicSettings:
        """The traitlets a line command reads or sets (``%taas``; ``taas.wait()``, kernel/magic/fromcode.py)."""
        return MagicSettings(self.warm, self._set_warm, self._session(), self._shell.user_ns, self._viewing, self._take)

    def _set_warm(self, text: str) -> None:
        self.warm = text  # validated as %config's is
