"""``%%taas`` and ``%taas``: orchestration only (parse -> plan -> run -> render).

Session defaults are traitlets, so ``%config TaasMagics.output = 'all'`` and
``ipython_config.py`` work; a pragma option always wins over a default.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import sys
import time
from dataclasses import dataclass

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from traitlets import Enum, Float, Int, TraitError, Unicode, validate

from taas_magic import checkpoints, wire
from taas_magic.autopsy import stacks
from taas_magic.cell.cellcode import CellCode, earlier_cells, translate
from taas_magic.cell.closure import select_closure, serialise_closure
from taas_magic.cell.pragma import MAX_RESTARTS, PragmaOptions, parse_cell, parse_size
from taas_magic.errors import ClusterError, RunInterrupted
from taas_magic.kernel.cluster import Cluster, address_from_environment
from taas_magic.kernel.dataplane import DataPlane, DataRun, default_cache_ram, describe_registered
from taas_magic.kernel.restarts import Attempts
from taas_magic.kernel.server import RankServer
from taas_magic.kernel.status import LastRun, header_line, help_text, status_text
from taas_magic.kernel.supervisor import RunOutcome, run_ranks
from taas_magic.launch.backend import Backend, ClusterBackend, LocalBackend, rank_environments
from taas_magic.launch.base import LaunchPlan, RankGroup
from taas_magic.launch.rankenv import RankChoice, choose_ranks, visible_gpu_count
from taas_magic.launch.spares import SparePool
from taas_magic.output.board import Board
from taas_magic.output.budget import HEAD_BYTES, HEAD_LINES, TAIL_LINES, OutputBudget
from taas_magic.output.relay import OutputRelay
from taas_magic.peers import Peer, PeerIds
from taas_magic.procs import OWNER_VARIABLE, kill_tagged
from taas_magic.runspec import RunSpec
from taas_magic.tempdirs import remove_tree
from taas_magic.transfer import cudaipc, memfile
from taas_magic.transfer.handoff import HANDOFF_BYTES, ClosureHandoff, closure_route
from taas_magic.transfer.pack import Packing
from taas_magic.transfer.results import apply_results
from taas_magic.writes.rule import MODES, OVERLAY, ScratchLayers, WriteRule, choose_rule, find_repository, probe_overlay

INLINE_ALWAYS = 1 << 62  # a threshold no closure reaches: its bytes travel in the frames


@dataclass(frozen=True)
class _Run:
    """One cell's run, planned: what the ranks receive and where they run."""

    options: PragmaOptions
    spec: RunSpec
    packing: Packing  # the closure as shipped: rank 0's results refer to its untouched tensors
    registered: list  # the registered loaders, by index
    data: DataRun | None
    backend: Backend
    rule: WriteRule
    timeout: float | None
    restarts: int  # --restarts K
    checkpoints: str  # this run's checkpoint folder (checkpoints.py)


def _notebook_sources(spec: RunSpec) -> dict[str, tuple[str, list[str]]]:
    """The cell's lines and earlier cells' (the autopsy shows frames there at their cell lines)."""
    sources = {name: (f"Cell In[{number}]", lines) for name, (number, lines) in spec.cells.items()}
    sources[spec.filename] = ("Cell", spec.display_source.splitlines())
    return sources


@magics_class
class TaasMagics(Magics):
    output = Enum(("rank0", "all"), "rank0", config=True, help="Default for --output.")
    timeout = Float(None, allow_none=True, config=True, help="Default for --timeout, in seconds.")
    cache_ram = Unicode("", config=True, help="Default for --cache-ram (e.g. '4G'); empty: min(4G, half of /dev/shm free).")
    max_output_lines = Int(HEAD_LINES, config=True, help="Lines of rank output a cell shows before the rest goes to a log file.")
    max_output_bytes = Int(HEAD_BYTES, config=True, help="Bytes of rank output a cell shows before the rest goes to a log file.")
    tail_output_lines = Int(TAIL_LINES, config=True, help="Last lines shown at the end of a cell whose output was elided.")
    closure_file_bytes = Int(HANDOFF_BYTES, config=True, help="Closures this large reach the ranks as one shared file.")
    warm = Unicode("auto", config=True, help="Warm spares: 'auto' (as many as the last cell's --gpus), 'off', or a number.")
    ahead = Int(16, config=True, help="Default for --ahead: elements per rank that may wait before workers pause.")
    place_timeout = Float(60.0, config=True, help="Default for --place-timeout: seconds to wait for a cluster's GPUs.")
    restarts = Int(0, config=True, help="Default for --restarts: times a failed run starts again within its cell.")
    checkpoint_dir = Unicode("", config=True, help="Where taas.save_checkpoint writes, a folder per run; "
                             "empty: <repository>/.taas/checkpoints.")
    keep_checkpoints = Int(2, config=True, help="Checkpoints kept per run, the newest; older ones go as new ones land.")

    @validate("warm")
    def _valid_warm(self, proposal):
        value = proposal["value"]
        if value not in ("off", "auto") and not value.isdigit():
            raise TraitError(f"TaasMagics.warm must be 'off', 'auto' or a number of spares, got {value!r}")
        return value

    @validate("cache_ram")
    def _valid_cache_ram(self, proposal):
        value = proposal["value"]
        if value and parse_size(value) is None:
            raise TraitError(f"TaasMagics.cache_ram must be a size such as 512M or 4G (or empty: automatic), got {value!r}")
        return value

    @validate("timeout", "place_timeout")
    def _valid_seconds(self, proposal):
        value = proposal["value"]
        if value is not None and not value > 0:
            raise TraitError(f"TaasMagics.{proposal['trait'].name} must be a positive number of seconds, got {value!r}")
        return value

    @validate("ahead", "max_output_lines", "max_output_bytes", "tail_output_lines", "closure_file_bytes",
              "keep_checkpoints")
    def _valid_count(self, proposal):
        least = {"ahead": 2, "max_output_lines": 1, "max_output_bytes": 1, "keep_checkpoints": 1}.get(
            proposal["trait"].name, 0)
        if proposal["value"] < least:
            raise TraitError(f"TaasMagics.{proposal['trait'].name} must be at least {least}, got {proposal['value']!r}")
        return proposal["value"]

    @validate("restarts")
    def _valid_restarts(self, proposal):
        if not 0 <= proposal["value"] <= MAX_RESTARTS:
            raise TraitError(f"TaasMagics.restarts must be 0..{MAX_RESTARTS}, got {proposal['value']!r}")
        return proposal["value"]

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.last_run: LastRun | None = None
        self.repository: str | None = None  # %taas config repo PATH
        self.isolation = "auto"  # %taas config isolation auto|overlay|python (overlay: refused where unavailable)
        self.spares = SparePool()
        if self.warm.isdigit():
            self.spares.fill(int(self.warm), visible_gpu_count(), visible_gpu_count())
        self.cluster: Cluster | None = None  # %taas cluster ADDRESS, or $TAAS_CLUSTER at load
        address = address_from_environment()
        if address is not None:
            try:
                self.cluster = Cluster.attach(address)
            except ClusterError as exc:  # the extension still loads: the local mode works
                print(f"{exc} ($TAAS_CLUSTER); cells run as local processes", file=sys.stderr)

    @property
    def _shell(self) -> InteractiveShell:
        assert self.shell is not None, "TaasMagics is registered with a shell"
        return self.shell

    def _write_rule(self) -> WriteRule:
        return choose_rule(find_repository(os.getcwd(), self.repository), self.isolation)

    @cell_magic("taas")  # type: ignore[arg-type]  # IPython's decorator types are too narrow
    def taas_cell(self, line: str, cell: str):
        """Run this cell as N DDP ranks: ``%%taas --gpus N [...]`` (see ``%taas help``)."""
        try:
            return self._taas_cell(line, cell)
        except KeyboardInterrupt:  # every rank is stopped and the autopsy shown: one line, not our frames
            raise RunInterrupted() from None

    def _taas_cell(self, line: str, cell: str):
        parsed = parse_cell(cell, line)
        options, choice = self._choose_ranks(parsed.options)
        code = translate(self._shell, parsed.source)
        closure = select_closure(code.tree, self._shell.user_ns, self._shell.user_ns_hidden)
        import taas

        registered = taas.registered()
        packing = serialise_closure(closure, registered)
        used = sorted(packing.externals_used)
        data = self._data_run({index: registered[index] for index in used}, options) if used else None
        backend = self._backend(options)  # the one place that asks which: placement held from here on
        try:
            run = self._plan(options, code, closure, packing, registered, data, backend, choice)
            return self._run(run)
        finally:
            backend.release()  # whatever happened (idempotent): ports, agents and GPUs given back, spares refilled

    def _choose_ranks(self, options: PragmaOptions) -> tuple[PragmaOptions, RankChoice]:
        """``--gpus auto`` made a number, against this host's GPUs or the cluster's, before anything is held."""
        if self.cluster is None:
            choice = choose_ranks(options.gpus, options.device, visible_gpu_count())
        else:
            if options.device == "cpu":
                raise UsageError("taas: --device cpu runs the ranks on this host's CPU, but a cluster is attached "
                                 "(its ranks run on its GPUs); %taas cluster local runs cells on this host again")
            gpus = sum(node.gpus_total for node in self.cluster.nodes())
            choice = choose_ranks(options.gpus, options.device, gpus, where="the cluster")
        return dataclasses.replace(options, gpus=choice.ranks), choice

    def _backend(self, options: PragmaOptions) -> Backend:
        assert isinstance(options.gpus, int), "_choose_ranks made it a number"
        if self.cluster is None:
            spares = self.spares if self.warm != "off" else None
            ranks = options.gpus
            return LocalBackend(ranks, spares, lambda: int(self.warm) if self.warm.isdigit() else ranks, options.device)
        wait = options.place_timeout if options.place_timeout is not None else self.place_timeout
        return ClusterBackend.place(self.cluster, options.gpus, options.per_host, wait)

    def _plan(self, options: PragmaOptions, code: CellCode, closure: dict, packing: Packing, registered: list,
              data: DataRun | None, backend: Backend, choice: RankChoice) -> _Run:
        """Everything the run needs, decided before anything starts; prints the header."""
        run_id = secrets.token_hex(6)
        memfile.sweep_all()  # what a killed kernel left in /dev/shm
        file_bytes = self.closure_file_bytes if backend.memory_files else INLINE_ALWAYS
        spec = RunSpec(
            run_id=run_id, sys_path=tuple(sys.path), source=code.source, display_source=code.display_source,
            filename=code.filename, device=backend.devices.device, output=options.output or self.output,
            suppress_final=code.suppress_final, kernel_pid=os.getpid(), result_file_bytes=file_bytes,
            feeds=data.rank_feeds() if data is not None else (), cells=earlier_cells(self._shell, packing.skeleton),
            # CUDA tensors by CUDA IPC: only among processes of this host on its GPUs, the kernel's CUDA in use
            cuda_ipc=backend.memory_files and backend.devices.device == "cuda" and cudaipc.kernel_ready(),
        )
        rule = self._write_rule()
        root = self.checkpoint_dir or os.path.join(rule.repository, ".taas", "checkpoints")
        run = _Run(options, spec, packing, registered, data, backend, rule,
                   options.timeout if options.timeout is not None else self.timeout,
                   options.restarts if options.restarts is not None else self.restarts,
                   os.path.join(os.path.realpath(os.path.expanduser(root)), run_id))
        tensor_bytes = memfile.layout([blob.nbytes for blob in packing.blobs])[1]
        route = closure_route(packing, spec.cuda_ipc, file_bytes)
        lines = [header_line(options, backend.devices, run_id, len(packing.skeleton) + tensor_bytes, route, run.restarts,
                             choice.why), run.rule.header(), backend.layout(), data.header() if data is not None else None]
        print("\ntaas: ".join(line for line in lines if line), flush=True)
        self.last_run = LastRun(options=options, devices=backend.devices, run_id=run_id, closure_names=tuple(closure))
        return run

    def _run(self, run: _Run):
        """Start, supervise and always clean up; then bind rank 0's results."""
        record = self.last_run
        assert record is not None
        peers = PeerIds(len(run.backend.slots), run.data.workers if run.data is not None else 0)
        server = RankServer(wire.new_key(), len(peers), run.backend.listen_host)
        layers = ScratchLayers(peers.ranks, peers.workers)
        stacks_dir = stacks.make_dir(run.spec.run_id)
        handoff: ClosureHandoff | None = None
        outcome = None
        started = time.monotonic()
        try:
            handoff = ClosureHandoff(run.packing, run.spec.run_id, run.spec.result_file_bytes, cuda_ipc=run.spec.cuda_ipc)
            bodies = [wire.encode_body("spec", wire.dumps(run.spec)), handoff.body]
            outcome = self._supervise(run, peers, server, layers, stacks_dir, bodies)
            record.outcome = "ok"
        except BaseException as exc:
            record.outcome = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise
        finally:
            record.seconds = time.monotonic() - started
            server.close()
            kill_tagged(f"{os.getpid()}-{run.spec.run_id}-")  # what the ranks and workers started and left
            run.backend.release()  # no rank is left: the spares start warming now, not after the clean-up and the results
            remove_tree(stacks_dir)
            checkpoints.finished_run(run.checkpoints)
            for line in layers.report(run.rule.repository):
                print(line, file=sys.stderr)
            layers.remove()
            if handoff is not None:
                handoff.remove()
            if run.data is not None:
                run.data.close()
            if outcome is None:  # rank 0 may have written its results before the run failed
                memfile.remove_run(os.getpid(), run.spec.run_id)
        try:
            return apply_results(self._shell.user_ns, outcome.result, run.packing, run.registered)
        finally:
            memfile.remove_run(os.getpid(), run.spec.run_id)

    def _supervise(self, run: _Run, peers: PeerIds, server: RankServer, layers: ScratchLayers, stacks_dir: str,
                   bodies: list[bytes]) -> RunOutcome:
        """Every rank's environment and the handshake; then the ranks (and data workers), supervised."""
        from taas_magic import protocol
        from taas_magic.kernel.supervisor import RunParts
        from taas_magic.output.relay import publisher

        owner = f"{os.getpid()}-{run.spec.run_id}-ranks"
        handshake = wire.Handshake(server.address[0], server.address[1], server.key).line()
        budget = OutputBudget(run.spec.run_id, self.max_output_lines, self.max_output_bytes, self.tail_output_lines)
        streams = {"stdout": sys.stdout, "stderr": sys.stderr}
        data = run.data
        publish = publisher(self._shell.display_pub)
        # The spec as protocol.py's Spec frame: bodies[0] is the spec pickled bare by _run (outside this
        # function); once _run sends protocol.encode(protocol.Spec(run.spec)), pass bodies as they are.
        to_ranks = [protocol.encode(protocol.Spec(run.spec)), *bodies[1:]]

        def greeting(peer: Peer) -> list[bytes]:
            if peer.is_rank:
                return to_ranks
            assert data is not None  # a data worker exists only with a data plan
            return data.greeting(peer.index)

        def start_data() -> DataPlane:
            assert data is not None
            start = functools.partial(data.start, run.spec.run_id, handshake, peers, layers.worker_dirs,
                                      run.rule, publish)
            return run.backend.start_data(data, start, server.key)

        def start_ranks(attempt: int) -> RankGroup:
            if attempt:
                run.backend.recover()  # a host that went away: its ranks are placed elsewhere
            envs = self._rank_envs(run, layers, stacks_dir, owner, attempt)
            return run.backend.start_ranks(LaunchPlan(peers.ranks, envs, os.getcwd(), handshake), server.key)

        def between(attempt: int) -> None:  # a failed attempt's processes are gone: so is what they left
            kill_tagged(owner)
            memfile.remove_run(os.getpid(), run.spec.run_id)

        explain = functools.partial(stacks.autopsy, sources=_notebook_sources(run.spec), cell=run.spec.filename)
        board = Board(peers.ranks, publish)
        parts = RunParts(server, peers, greeting,
                         lambda on_marker: OutputRelay(run.spec.output, peers, streams, budget=budget, on_marker=on_marker),
                         publish, board, run.timeout, explain)
        try:
            return run_ranks(parts, start_ranks, start_data if data is not None else None,
                             Attempts(run.restarts, between, run.backend.standby))
        finally:
            import taas

            taas._last_metrics = board.metrics()  # a failed run's reports too: what it reached is worth seeing

    def _rank_envs(self, run: _Run, layers: ScratchLayers, stacks_dir: str, owner: str,
                   attempt: int) -> list[dict[str, str]]:
        """torchrun's variables, the write rule, and what restarts, checkpoints and the autopsy need."""
        envs = rank_environments(run.backend, dict(os.environ), run.spec.run_id)
        for rank, env in enumerate(envs):
            env.update(TORCHELASTIC_RESTART_COUNT=str(attempt), TORCHELASTIC_MAX_RESTARTS=str(run.restarts),
                       TAAS_CHECKPOINTS=run.checkpoints, TAAS_KEEP_CHECKPOINTS=str(self.keep_checkpoints),
                       TAAS_STACKS_FILE=os.path.join(stacks_dir, f"rank-{rank}"))
            env[OWNER_VARIABLE] = owner
        for rank, layer in layers.dirs.items():
            envs[rank].update(TAAS_REPOSITORY=run.rule.repository, TAAS_WRITE_LAYER=layer, TAAS_WRITE_MODE=run.rule.mode)
        return envs

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

    def _data_run(self, loaders: dict, options) -> DataRun:
        if options.cache_ram is not None:
            cache_ram = options.cache_ram
        elif self.cache_ram:
            cache_ram = parse_size(self.cache_ram)  # validated when set
        else:
            cache_ram = default_cache_ram()
        return DataRun(
            loaders,
            self._shell.user_ns,
            units=options.units,
            ranks=options.gpus,
            workers=options.cpus,
            cache_ram=cache_ram,
            ahead=options.ahead if options.ahead is not None else self.ahead,
        )

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

    def _publish(self, kind: str, message: dict) -> None:
        display_pub = self._shell.display_pub
        if kind == "clear_output":
            display_pub.clear_output(wait=message["wait"])
            return
        kwargs = {"metadata": message["metadata"]}
        if message["transient"]:
            kwargs["transient"] = message["transient"]
        if message["update"]:
            kwargs["update"] = True
        display_pub.publish(message["data"], **kwargs)

    @line_magic("taas")  # type: ignore[arg-type]  # IPython's decorator types are too narrow
    def taas_line(self, line: str):
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
            if words[1] not in ("off", "auto") and not words[1].isdigit():
                raise UsageError(f"taas: warm must be off, auto or a number of spares, got {words[1]!r}")
            self.warm = words[1]
            if words[1] == "off":
                self.spares.close()
                print("taas: warm spares off")
            elif words[1].isdigit():
                self.spares.fill(int(words[1]), visible_gpu_count(), visible_gpu_count())
                print(f"taas: keeping {words[1]} warm spare rank(s)")
            else:
                print("taas: after each cell, keeping as many warm spares as its --gpus")
        elif words[:1] == ["cluster"] and len(words) == 2:
            self._attach(words[1])
        elif command == "help":
            print(help_text())
        elif command == "status":
            rule = self._write_rule()
            defaults = {"output": self.output, "timeout": self.timeout, "cache-ram": self.cache_ram or "auto",
                        "ahead": self.ahead}
            print(status_text(self.last_run, visible_gpu_count(), defaults, self._registered_lines()))
            spares = len(self.spares.spares)
            print(f"warm spares: {self.warm}, {spares} waiting, {self.spares.resident_bytes() / 2**20:.0f} MB resident"
                  + self._spares_gpu_text())
            print("write rule: " + rule.header())
            print("\n".join(self.cluster.status_lines()) if self.cluster is not None else "cluster: none (local processes)")
        else:
            raise UsageError(f"taas: unknown %taas command {command!r}; try %taas help or %taas status")
