"""``%%taas`` and ``%taas``: orchestration only (parse -> plan -> run -> render).

Session defaults are traitlets, so ``%config TaasMagics.output = 'all'`` and
``ipython_config.py`` work (kernel/settings.py makes them from the option table);
``pragma.settle`` decides each run's settings once, a pragma option always winning over a
default. The plan step builds the run object (kernel/run.py), which holds every part of
the run and releases all of them, in reverse order, however the cell ends; the run step
(kernel/execute.py) starts and supervises its ranks. ``_backend`` is the one place that
chooses a backend (local processes or the attached cluster).

The session's state (kernel/session.py: repository, isolation, warm spares, cluster, last
run) is the magic's ``session``; ``%taas`` line commands (kernel/commands.py) change it and
are given the traitlets they read or set, never the magic.
"""

from __future__ import annotations

import os
import secrets
import sys
from contextlib import ExitStack
from typing import Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from traitlets import Int, Unicode, validate

from taas_magic.cell.cellcode import CellCode, earlier_cells, translate
from taas_magic.cell.closure import select_closure, serialise_closure
from taas_magic.cell.pragma import SETTINGS, PragmaOptions, RunSettings, parse_cell, settle
from taas_magic.checkpoints import DEFAULT_KEEP
from taas_magic.errors import RunInterrupted
from taas_magic.kernel import commands
from taas_magic.kernel.dataplane import DataRun
from taas_magic.kernel.execute import execute
from taas_magic.kernel.run import Run
from taas_magic.kernel.session import Session
from taas_magic.kernel.settings import VALIDATED, Warm, option_trait, refuse
from taas_magic.kernel.status import LastRun, closure_size, header_line
from taas_magic.launch.backend import Backend, ClusterBackend, LocalBackend
from taas_magic.launch.rankenv import choose_ranks, visible_gpu_count
from taas_magic.launch.spares import SparePool
from taas_magic.output.budget import HEAD_BYTES, HEAD_LINES, TAIL_LINES, OutputBudget
from taas_magic.output.relay import publisher
from taas_magic.runspec import RunSpec
from taas_magic.transfer import cudaipc, memfile
from taas_magic.transfer.handoff import HANDOFF_BYTES, closure_route
from taas_magic.writes.rule import WriteRule

INLINE_ALWAYS = 1 << 62  # a threshold no closure reaches: its bytes travel in the frames


@magics_class
class TaasMagics(Magics):
    output = option_trait("--output", "Default for --output.")
    timeout = option_trait("--timeout", "Default for --timeout, in seconds.")
    cache_ram = option_trait("--cache-ram", "Default for --cache-ram (e.g. '4G'); empty: min(4G, half of /dev/shm free).")
    ahead = option_trait("--ahead", "Default for --ahead: elements per rank that may wait before workers pause.")
    place_timeout = option_trait("--place-timeout", "Default for --place-timeout: seconds to wait for a cluster's GPUs.")
    restarts = option_trait("--restarts", "Default for --restarts: times a failed run starts again within its cell.")
    max_output_lines = Int(HEAD_LINES, config=True, help="Lines of rank output a cell shows before the rest goes to a log file.")
    max_output_bytes = Int(HEAD_BYTES, config=True, help="Bytes of rank output a cell shows before the rest goes to a log file.")
    tail_output_lines = Int(TAIL_LINES, config=True, help="Last lines shown at the end of a cell whose output was elided.")
    closure_file_bytes = Int(HANDOFF_BYTES, config=True, help="Closures this large reach the ranks as one shared file.")
    warm = Unicode("auto", config=True, help="Warm spares: 'auto' (as many as the last cell's --gpus), 'off', or a number.")
    checkpoint_dir = Unicode("", config=True, help="Where taas.save_checkpoint writes, a folder per run; "
                             "empty: <repository>/.taas/checkpoints.")
    keep_checkpoints = Int(DEFAULT_KEEP, config=True,
                           help="Checkpoints kept per run, the newest; older ones go as new ones land.")

    @validate(*VALIDATED)
    def _valid_setting(self, proposal: dict[str, Any]) -> object:
        return refuse(proposal["trait"].name, proposal["value"])

    def __init__(self, shell: InteractiveShell | None = None, **kwargs: Any) -> None:
        super().__init__(shell=shell, **kwargs)
        self.session = Session.start(self._warm)  # what %taas commands set and cells read (kernel/session.py)

    @property
    def spares(self) -> SparePool:
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
        """Run this cell as N DDP ranks: ``%%taas --gpus N [...]`` (see ``%taas help``)."""
        try:
            return self._taas_cell(line, cell)
        except KeyboardInterrupt:  # every rank is stopped and the autopsy shown: one line, not our frames
            raise RunInterrupted() from None

    def _taas_cell(self, line: str, cell: str) -> object:
        parsed = parse_cell(cell, line)
        settings, why = self._settle(parsed.options)
        code = translate(self._shell, parsed.source)
        closure = select_closure(code.tree, self._shell.user_ns, self._shell.user_ns_hidden)
        with self._plan(settings, code, closure, why) as run:  # whatever happens, all of it released on leaving
            budget = OutputBudget(run.spec.run_id, self.max_output_lines, self.max_output_bytes, self.tail_output_lines)
            outcome = execute(run, publisher(self._shell.display_pub), budget)
        return run.bind_results(outcome.result, self._shell.user_ns)

    def _settle(self, options: PragmaOptions) -> tuple[RunSettings, str | None]:
        """The run's settings (the pragma over the session), ``--gpus auto`` made a number against this
        host's GPUs or the cluster's, before anything is held; and why that number, for the header."""
        cluster = self.session.cluster
        if cluster is None:
            choice = choose_ranks(options.gpus, options.device, visible_gpu_count())
        else:
            if options.device == "cpu":
                raise UsageError("taas: --device cpu runs the ranks on this host's CPU, but a cluster is attached "
                                 "(its ranks run on its GPUs); %taas cluster local runs cells on this host again")
            gpus = sum(node.gpus_total for node in cluster.nodes())
            choice = choose_ranks(options.gpus, options.device, gpus, where="the cluster")
        return settle(options, self._session(), choice.ranks), choice.why

    def _session(self) -> dict[str, object]:
        """This session's value of every setting that is an option's default."""
        return {name: getattr(self, name) for name in SETTINGS}

    def _backend(self, settings: RunSettings) -> Backend:
        cluster = self.session.cluster
        if cluster is None:
            spares = None if self._warm.off else self.spares
            return LocalBackend(settings.gpus, spares, lambda: self._warm.after(settings.gpus), settings.device)
        return ClusterBackend.place(cluster, settings.gpus, settings.per_host, settings.place_timeout)

    def _plan(self, settings: RunSettings, code: CellCode, closure: dict, why: str | None) -> Run:
        """Everything the run needs, decided and held before anything starts; prints the header."""
        import taas

        registered = taas.registered()
        run = Run(settings, serialise_closure(closure, registered), registered)
        with ExitStack() as undo:
            undo.push(run)  # a plan that fails half-way releases what it took
            used = sorted(run.packing.externals_used)
            run.hold_data(self._data_run({index: registered[index] for index in used}, settings) if used else None)
            backend = run.hold_backend(self._backend(settings))  # the one place that asks which: placement held from here
            rule = self.session.write_rule()
            spec = self._spec(run, code, rule)
            tensor_bytes = memfile.layout([blob.nbytes for blob in run.packing.blobs])[1]
            route = closure_route(run.packing, spec.cuda_ipc, spec.result_file_bytes)
            closure_text = closure_size(len(run.packing.skeleton) + tensor_bytes, route)
            lines = [header_line(settings, backend.devices, spec.run_id, closure_text, why), rule.header(),
                     backend.layout(), run.data.header() if run.data is not None else None]
            print("\ntaas: ".join(line for line in lines if line), flush=True)
            self.session.last_run = LastRun(settings, backend.devices, spec.run_id, tuple(closure))
            run.open(spec, rule, self.session.last_run)
            undo.pop_all()
        return run

    def _spec(self, run: Run, code: CellCode, rule: WriteRule) -> RunSpec:
        """What every rank receives: the cell, where it runs, and the run's data (checkpoints, seed)."""
        run_id = secrets.token_hex(6)
        memfile.sweep_all()  # what a killed kernel left in /dev/shm
        backend, data = run.backend, run.data
        root = self.checkpoint_dir or os.path.join(rule.repository, ".taas", "checkpoints")
        return RunSpec(
            run_id=run_id, sys_path=tuple(sys.path), source=code.source, display_source=code.display_source,
            filename=code.filename, device=backend.devices.device, output=run.settings.output,
            suppress_final=code.suppress_final, kernel_pid=os.getpid(),
            result_file_bytes=self.closure_file_bytes if backend.memory_files else INLINE_ALWAYS,
            feeds=data.rank_feeds() if data is not None else (), cells=earlier_cells(self._shell, run.packing.skeleton),
            # CUDA tensors by CUDA IPC: only among processes of this host on its GPUs, the kernel's CUDA in use
            cuda_ipc=backend.memory_files and backend.devices.device == "cuda" and cudaipc.kernel_ready(),
            checkpoints=os.path.join(os.path.realpath(os.path.expanduser(root)), run_id),
            keep_checkpoints=self.keep_checkpoints, seed=data.seed if data is not None else secrets.randbits(31),
        )

    def _data_run(self, loaders: dict, settings: RunSettings) -> DataRun:
        return DataRun(loaders, self._shell.user_ns, settings)

    @line_magic("taas")  # type: ignore[arg-type]  # IPython's decorator types are too narrow
    def taas_line(self, line: str) -> None:
        """``%taas help`` | ``status`` | ``config repo PATH`` | ``config isolation auto|python`` | ``warm off|auto|N``."""
        settings = commands.MagicSettings(self.warm, self._set_warm, self._session(), self._shell.user_ns)
        commands.run(line, self.session, settings)

    def _set_warm(self, text: str) -> None:
        self.warm = text  # validated as %config's is
