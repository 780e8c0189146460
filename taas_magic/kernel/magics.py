"""``%%taas`` and ``%taas``: orchestration only (parse -> plan -> run -> render).

Session defaults are traitlets, so ``%config TaasMagics.output = 'all'`` and
``ipython_config.py`` work (kernel/settings.py makes them from the option table);
``pragma.settle`` decides each run's settings once, a pragma option always winning over a
default. The plan step builds the run object (kernel/run.py), which holds every part of
the run and releases all of them, in reverse order, however the cell ends.
"""

from __future__ import annotations

import functools
import os
import secrets
import sys
from contextlib import ExitStack
from typing import Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from traitlets import Int, Unicode, validate

from taas_magic import wire
from taas_magic.autopsy import stacks
from taas_magic.cell.cellcode import CellCode, earlier_cells, translate
from taas_magic.cell.closure import select_closure, serialise_closure
from taas_magic.cell.pragma import SETTINGS, PragmaOptions, RunSettings, parse_cell, settle, shown_defaults
from taas_magic.checkpoints import DEFAULT_KEEP
from taas_magic.errors import ClusterError, RunInterrupted
from taas_magic.kernel.cluster import Cluster, address_from_environment
from taas_magic.kernel.dataplane import DataPlane, DataRun, describe_registered
from taas_magic.kernel.restarts import Attempts
from taas_magic.kernel.run import Run
from taas_magic.kernel.settings import VALIDATED, Warm, option_trait, refuse
from taas_magic.kernel.status import LastRun, closure_size, header_line, help_text, status_text
from taas_magic.kernel.supervisor import RunOutcome, RunParts, run_ranks
from taas_magic.launch.backend import Backend, ClusterBackend, LocalBackend
from taas_magic.launch.base import ProcessGroup
from taas_magic.launch.rankenv import choose_ranks, visible_gpu_count
from taas_magic.launch.spares import SparePool
from taas_magic.output.board import Board
from taas_magic.output.budget import HEAD_BYTES, HEAD_LINES, TAIL_LINES, OutputBudget
from taas_magic.output.relay import OutputRelay, publisher
from taas_magic.peers import Peer
from taas_magic.procs import kill_tagged
from taas_magic.runspec import RunSpec
from taas_magic.transfer import cudaipc, memfile
from taas_magic.transfer.handoff import HANDOFF_BYTES, closure_route
from taas_magic.writes.rule import MODES, OVERLAY, WriteRule, choose_rule, find_repository, probe_overlay

INLINE_ALWAYS = 1 << 62  # a threshold no closure reaches: its bytes travel in the frames


def _notebook_sources(spec: RunSpec) -> dict[str, tuple[str, list[str]]]:
    """The cell's lines and earlier cells' (the autopsy shows frames there at their cell lines)."""
    sources = {name: (f"Cell In[{number}]", lines) for name, (number, lines) in spec.cells.items()}
    sources[spec.filename] = ("Cell", spec.display_source.splitlines())
    return sources


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
        self.last_run: LastRun | None = None
        self.repository: str | None = None  # %taas config repo PATH
        self.isolation = "auto"  # %taas config isolation auto|overlay|python (overlay: refused where unavailable)
        self.spares = SparePool()
        if self._warm.count is not None:
            self.spares.fill(self._warm.count, visible_gpu_count(), visible_gpu_count())
        self.cluster: Cluster | None = None  # %taas cluster ADDRESS, or $TAAS_CLUSTER at load
        address = address_from_environment()
        if address is not None:
            try:
                self.cluster = Cluster.attach(address)
            except ClusterError as exc:  # the extension still loads: the local mode works
                print(f"{exc} ($TAAS_CLUSTER); cells run as local processes", file=sys.stderr)

    @property
    def _warm(self) -> Warm:
        return Warm.parse(self.warm)  # validated when set

    @property
    def _shell(self) -> InteractiveShell:
        assert self.shell is not None, "TaasMagics is registered with a shell"
        return self.shell

    def _write_rule(self) -> WriteRule:
        return choose_rule(find_repository(os.getcwd(), self.repository), self.isolation)

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
            outcome = self._supervise(run)
        return run.bind_results(outcome.result, self._shell.user_ns)

    def _settle(self, options: PragmaOptions) -> tuple[RunSettings, str | None]:
        """The run's settings (the pragma over the session), ``--gpus auto`` made a number against this
        host's GPUs or the cluster's, before anything is held; and why that number, for the header."""
        if self.cluster is None:
            choice = choose_ranks(options.gpus, options.device, visible_gpu_count())
        else:
            if options.device == "cpu":
                raise UsageError("taas: --device cpu runs the ranks on this host's CPU, but a cluster is attached "
                                 "(its ranks run on its GPUs); %taas cluster local runs cells on this host again")
            gpus = sum(node.gpus_total for node in self.cluster.nodes())
            choice = choose_ranks(options.gpus, options.device, gpus, where="the cluster")
        return settle(options, self._session(), choice.ranks), choice.why

    def _session(self) -> dict[str, object]:
        """This session's value of every setting that is an option's default."""
        return {name: getattr(self, name) for name in SETTINGS}

    def _backend(self, settings: RunSettings) -> Backend:
        if self.cluster is None:
            spares = None if self._warm.off else self.spares
            return LocalBackend(settings.gpus, spares, lambda: self._warm.after(settings.gpus), settings.device)
        return ClusterBackend.place(self.cluster, settings.gpus, settings.per_host, settings.place_timeout)

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
            rule = self._write_rule()
            spec = self._spec(run, code, rule)
            tensor_bytes = memfile.layout([blob.nbytes for blob in run.packing.blobs])[1]
            route = closure_route(run.packing, spec.cuda_ipc, spec.result_file_bytes)
            closure_text = closure_size(len(run.packing.skeleton) + tensor_bytes, route)
            lines = [header_line(settings, backend.devices, spec.run_id, closure_text, why), rule.header(),
                     backend.layout(), run.data.header() if run.data is not None else None]
            print("\ntaas: ".join(line for line in lines if line), flush=True)
            self.last_run = LastRun(settings, backend.devices, spec.run_id, tuple(closure))
            run.open(spec, rule, self.last_run)
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

    def _supervise(self, run: Run) -> RunOutcome:
        """Every rank's environment and the handshake; then the ranks (and data workers), supervised."""
        peers, server, layers, bodies = run.peers, run.server, run.layers, run.bodies
        owner = run.owner
        handshake = wire.Handshake(server.address[0], server.address[1], server.key).line()
        budget = OutputBudget(run.spec.run_id, self.max_output_lines, self.max_output_bytes, self.tail_output_lines)
        streams = {"stdout": sys.stdout, "stderr": sys.stderr}
        data = run.data
        publish = publisher(self._shell.display_pub)

        def greeting(peer: Peer) -> list[bytes]:
            if peer.is_rank:
                return bodies
            assert data is not None  # a data worker exists only with a data plan
            return data.greeting(peer.index)

        def start_data() -> DataPlane:
            assert data is not None
            plan = data.prepare(run.spec.run_id, handshake, peers, layers.worker_dirs, run.rule)
            start = functools.partial(data.start, plan, publish)
            return run.backend.start_data(data.cache_ram, start, server.key)

        def start_ranks(attempt: int) -> ProcessGroup:
            if attempt:
                run.backend.recover()  # a host that went away: its ranks are placed elsewhere
            return run.backend.start_ranks(run.launch_plan(handshake, attempt), server.key)

        def between(attempt: int) -> None:  # a failed attempt's processes are gone: so is what they left
            kill_tagged(owner)
            memfile.remove_run(os.getpid(), run.spec.run_id)

        explain = functools.partial(stacks.autopsy, sources=_notebook_sources(run.spec), cell=run.spec.filename)
        board = Board(peers.ranks, publish)
        parts = RunParts(server, peers, greeting,
                         lambda on_marker: OutputRelay(run.spec.output, peers, streams, budget=budget, on_marker=on_marker),
                         publish, board, run.settings.timeout, explain)
        try:
            return run_ranks(parts, start_ranks, start_data if data is not None else None,
                             Attempts(run.settings.restarts, between, run.backend.standby))
        finally:
            import taas

            taas._last_metrics = board.metrics()  # a failed run's reports too: what it reached is worth seeing

    def _set_warm(self, text: str) -> None:
        """``%taas warm off|auto|N``."""
        try:
            warm = Warm.parse(text)
        except ValueError:
            raise UsageError(f"taas: warm must be off, auto or a number of spares, got {text!r}") from None
        self.warm = text
        if warm.off:
            self.spares.close()
            print("taas: warm spares off")
        elif warm.count is not None:
            self.spares.fill(warm.count, visible_gpu_count(), visible_gpu_count())
            print(f"taas: keeping {text} warm spare rank(s)")
        else:
            print("taas: after each cell, keeping as many warm spares as its --gpus")

    def _spares_gpu_text(self) -> str:
        """What the GPU-bound spares hold on their GPUs (their CUDA contexts), for ``%taas status``."""
        bound = self.spares.gpu_bound()
        if not bound:
            return ""
        held = self.spares.gpu_bytes()
        amount = f"{held / 2**20:.0f} MiB" if held is not None else "GPU memory unknown (nvidia-smi cannot see them)"
        return f"; {len(bound)} bound to GPU(s) {', '.join(str(s.gpu) for s in bound)}, {amount} on the GPUs"

    def _registered_lines(self) -> list[str]:
        import taas

        return [describe_registered(loader, self._shell.user_ns) for loader in taas.registered()]

    def _data_run(self, loaders: dict, settings: RunSettings) -> DataRun:
        return DataRun(loaders, self._shell.user_ns, settings)

    def _attach(self, address: str) -> None:
        if address == "local":
            if self.cluster is not None:
                self.cluster.detach()
                self.cluster = None
            print("taas: local mode (ranks are processes on this host)")
            return
        try:
            attached = Cluster.attach(address)  # an unreachable address fails before the current one is let go
        except ClusterError:
            if self.cluster is not None and not self.cluster.ray.is_initialized():
                self.cluster = None  # Ray let go of it before failing: the local mode now
            raise
        self.cluster = attached
        self.spares.close()  # the cluster's agents start fresh ranks; local spares only hold memory
        print("taas: attached; " + "\n".join(self.cluster.status_lines()))

    @line_magic("taas")  # type: ignore[arg-type]  # IPython's decorator types are too narrow
    def taas_line(self, line: str) -> None:
        """``%taas help`` | ``status`` | ``config repo PATH`` | ``config isolation auto|python`` | ``warm off|auto|N``."""
        command = line.strip() or "help"
        words = command.split(maxsplit=2)
        if words[:2] == ["config", "repo"] and len(words) == 3:
            path = os.path.realpath(os.path.expanduser(words[2]))
            if not os.path.isdir(path):
                raise UsageError(f"taas: the repository must be a directory, got {words[2]!r}")
            self.repository = path
            print(f"taas: repository {path}")
        elif words[:2] == ["config", "isolation"] and len(words) == 3:
            if words[2] not in MODES:
                raise UsageError(f"taas: isolation must be one of {', '.join(MODES)}, got {words[2]!r}")
            unavailable = probe_overlay() if words[2] == OVERLAY else None
            if unavailable is not None:
                raise UsageError(f"taas: isolation overlay is unavailable on this host ({unavailable}); "
                                 "use auto or python")
            self.isolation = words[2]
            print(f"taas: isolation {words[2]}")
        elif words[:1] == ["warm"] and len(words) == 2:
            self._set_warm(words[1])
        elif words[:1] == ["cluster"] and len(words) == 2:
            self._attach(words[1])
        elif command == "help":
            print(help_text())
        elif command == "status":
            rule = self._write_rule()
            defaults = shown_defaults(self._session())
            print(status_text(self.last_run, visible_gpu_count(), defaults, self._registered_lines()))
            spares = len(self.spares.spares)
            print(f"warm spares: {self.warm}, {spares} waiting, {self.spares.resident_bytes() / 2**20:.0f} MB resident"
                  + self._spares_gpu_text())
            print("write rule: " + rule.header())
            print("\n".join(self.cluster.status_lines()) if self.cluster is not None else "cluster: none (local processes)")
        else:
            raise UsageError(f"taas: unknown %taas command {command!r}; try %taas help or %taas status")
