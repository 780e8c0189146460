"""``%%taas`` and ``%taas``: orchestration only (parse -> plan -> run -> render).

Session defaults are traitlets, so ``%config TaasMagics.output = 'all'`` and
``ipython_config.py`` work; a pragma option always wins over a default.
"""

from __future__ import annotations

import os
import secrets
import sys
import time

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from traitlets import Enum, Float, Int, TraitError, Unicode, validate

from . import wire
from .budget import HEAD_BYTES, HEAD_LINES, TAIL_LINES, OutputBudget
from .cellcode import earlier_cells, translate
from .closure import select_closure, serialise_closure
from .cluster import Cluster, address_from_environment
from .errors import ClusterError
from .feed.run import DataPlane, DataRun, default_cache_ram, describe_registered
from .handoff import HANDOFF_BYTES, ClosureHandoff
from .isolation import MODES, OVERLAY, ScratchLayers, WriteRule, choose_rule, find_repository, probe_overlay
from .launch.base import LaunchPlan, RankGroup
from .launch.local import LocalRankGroup
from .launch.placement import RankSlot, plan_hosts
from .launch.ray import ClusterLaunch
from .launch.spares import SparePool
from .pragma import parse_cell, parse_size
from .rankenv import LOOPBACK, DevicePlan, plan_devices, rank_environment, reserve_port, visible_gpu_count
from .relay import OutputRelay
from .results import apply_results
from .server import RankServer
from .status import LastRun, header_line, help_text, status_text
from .supervisor import run_ranks
from .transfer import memfile
from .transfer.pack import Packing

# A cluster whose GPUs are declared Ray resources without CUDA devices (a CPU test cluster).
CLUSTER_CPU = DevicePlan("cpu", 0, "gloo")
INLINE_ALWAYS = 1 << 62


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

    @validate("ahead", "max_output_lines", "max_output_bytes", "tail_output_lines", "closure_file_bytes")
    def _valid_count(self, proposal):
        least = {"ahead": 2, "max_output_lines": 1, "max_output_bytes": 1}.get(proposal["trait"].name, 0)
        if proposal["value"] < least:
            raise TraitError(f"TaasMagics.{proposal['trait'].name} must be at least {least}, got {proposal['value']!r}")
        return proposal["value"]

    def __init__(self, shell=None, **kwargs):
        super().__init__(shell=shell, **kwargs)
        self.last_run: LastRun | None = None
        self.repository: str | None = None  # %taas config repo PATH
        self.isolation = "auto"  # %taas config isolation auto|overlay|python (overlay: refused where unavailable)
        self.spares = SparePool()
        if self.warm.isdigit():
            self.spares.fill(int(self.warm))
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
        parsed = parse_cell(cell, line)
        options = parsed.options
        output = options.output or self.output
        timeout = options.timeout if options.timeout is not None else self.timeout
        code = translate(self._shell, parsed.source)
        closure = select_closure(code.tree, self._shell.user_ns, self._shell.user_ns_hidden)
        import taas

        registered = taas.registered()
        packing = serialise_closure(closure, registered)
        used = sorted(packing.externals_used)
        data = self._data_run({index: registered[index] for index in used}, options) if used else None
        cluster = self._cluster_launch(options) if self.cluster is not None else None
        try:
            return self._launch(options, code, closure, packing, registered, data, cluster, output, timeout)
        finally:
            if cluster is not None:
                cluster.release()  # whatever happened: agents killed, GPUs given back

    def _launch(self, options, code, closure, packing: Packing, registered: list, data: DataRun | None,
                cluster: ClusterLaunch | None, output: str, timeout: float | None):
        """Build every rank's environment, start ranks (and data workers), supervise, render."""
        world_size = options.gpus
        workers = data.workers if data is not None else 0
        if cluster is not None:
            devices = DevicePlan("cuda", world_size, "nccl") if cluster.has_cuda else CLUSTER_CPU
            slots = cluster.slots
        else:
            devices = plan_devices(options.gpus)
            slots = [RankSlot(rank, rank, world_size, 0) for rank in range(world_size)]

        run_id = secrets.token_hex(6)
        memfile.sweep_all()  # what a killed kernel left in /dev/shm
        key = wire.new_key()
        # A memory file only reaches processes on this host: the cluster mode sends every byte in the frames.
        file_bytes = self.closure_file_bytes if cluster is None else INLINE_ALWAYS
        spec = {
            "run_id": run_id,
            "sys_path": list(sys.path),
            "source": code.source,
            "display_source": code.display_source,
            "filename": code.filename,
            "device": devices.device,
            "output": output,
            "suppress_final": code.suppress_final,
            "feeds": data.rank_feeds() if data is not None else [],
            "cells": earlier_cells(self._shell, packing.skeleton),
            "kernel_pid": os.getpid(),
            "result_file_bytes": file_bytes,
        }
        rule = self._write_rule()
        tensor_bytes = memfile.layout([blob.nbytes for blob in packing.blobs])[1]
        header = header_line(options, devices, run_id, len(packing.skeleton) + tensor_bytes, tensor_bytes >= file_bytes)
        header += "\ntaas: " + rule.header()
        if cluster is not None:
            header += "\ntaas: cluster: " + cluster.layout()
        if data is not None:
            header += "\ntaas: " + data.header()
        print(header, flush=True)

        record = LastRun(options=options, devices=devices, run_id=run_id, closure_names=tuple(closure))
        self.last_run = record
        port_reservation = reserve_port() if cluster is None else None
        if cluster is None:
            assert port_reservation is not None
            master_addr, master_port = LOOPBACK, port_reservation.getsockname()[1]
        else:
            master_addr, master_port = cluster.master_addr, cluster.master_port
        server = RankServer(key, world_size + workers, LOOPBACK if cluster is None else cluster.kernel_address)
        layers = ScratchLayers(world_size, workers)
        handoff: ClosureHandoff | None = None
        finished = False
        started = time.monotonic()
        try:
            handoff = ClosureHandoff(packing, run_id, file_bytes)
            bodies = [wire.encode_body("spec", wire.dumps(spec)), handoff.body]
            envs = [
                rank_environment(
                    dict(os.environ),
                    rank=slot.rank,
                    local_rank=slot.local_rank,
                    world_size=world_size,
                    local_world_size=slot.local_world_size,
                    group_rank=slot.group_rank,
                    master_addr=master_addr,
                    master_port=master_port,
                    run_id=run_id,
                    loopback_only=cluster is None,
                )
                for slot in slots
            ]
            if cluster is not None and devices.device == "cuda":
                for rank, env in enumerate(envs):  # LOCAL_RANK indexes the GPUs Ray gave that host's agent
                    env["CUDA_VISIBLE_DEVICES"] = cluster.host_gpu_ids(rank)
            for rank, layer in layers.dirs.items():
                envs[rank].update(TAAS_REPOSITORY=rule.repository, TAAS_WRITE_LAYER=layer, TAAS_WRITE_MODE=rule.mode)
            handshake = wire.Handshake(server.address[0], server.address[1], key).line()
            plan = LaunchPlan(world_size, envs, os.getcwd(), handshake)
            budget = OutputBudget(run_id, self.max_output_lines, self.max_output_bytes, self.tail_output_lines)
            relay = OutputRelay(output, world_size, {"stdout": sys.stdout, "stderr": sys.stderr}, workers=workers, budget=budget)

            def greeting(peer: int) -> list[bytes]:
                if peer < world_size:
                    return bodies
                assert data is not None  # only data workers have peer ids past the ranks
                return data.greeting(peer - world_size)

            def start_data() -> DataPlane:
                assert data is not None
                if cluster is None:
                    return data.start(run_id, handshake, world_size, layers.worker_dirs, rule, self._publish)
                plane = data.start(run_id, handshake, world_size, layers.worker_dirs, rule, self._publish,
                                   launch=lambda plan, dirs: cluster.start_workers(plan, key, dirs),
                                   courier=lambda: cluster.courier(data.cache_ram))
                print(f"taas: data {cluster.worker_layout}", flush=True)
                return plane

            spares = self.spares if self.warm != "off" else None

            def start_ranks() -> RankGroup:
                if cluster is not None:
                    return cluster.start(envs, os.getcwd(), handshake, key)
                return LocalRankGroup.start(plan, spares=spares)

            outcome = run_ranks(start_ranks, server, greeting, relay, self._publish, timeout,
                                start_data if data is not None else None)
            record.outcome = "ok"
            finished = True
        except BaseException as exc:
            record.outcome = f"{type(exc).__name__}: {exc}".splitlines()[0]
            raise
        finally:
            record.seconds = time.monotonic() - started
            if port_reservation is not None:
                port_reservation.close()
            server.close()
            for line in layers.report(rule.repository):
                print(line, file=sys.stderr)
            layers.remove()
            if handoff is not None:
                handoff.remove()
            if self.warm != "off" and cluster is None:  # for the next cell, now that this one no longer needs the CPU
                self.spares.fill(int(self.warm) if self.warm.isdigit() else world_size)
            if data is not None:
                data.close()
            if not finished:  # rank 0 may have written its results before the run failed
                memfile.remove_run(os.getpid(), run_id)
        try:
            return apply_results(self._shell.user_ns, outcome.result, packing, registered)
        finally:
            memfile.remove_run(os.getpid(), run_id)

    def _cluster_launch(self, options) -> ClusterLaunch:
        """Plan the hosts and hold their GPUs; raises (nothing started) if the cluster cannot."""
        assert self.cluster is not None
        shares = plan_hosts(self.cluster.nodes(), options.gpus, options.per_host)
        wait = options.place_timeout if options.place_timeout is not None else self.place_timeout
        return ClusterLaunch(self.cluster.ray, shares, wait, self.cluster.nodes)

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
                self.spares.fill(int(words[1]))
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
            print(f"warm spares: {self.warm}, {spares} waiting, {self.spares.resident_bytes() / 2**20:.0f} MB resident")
            print("write rule: " + rule.header())
            print("\n".join(self.cluster.status_lines()) if self.cluster is not None else "cluster: none (local processes)")
        else:
            raise UsageError(f"taas: unknown %taas command {command!r}; try %taas help or %taas status")
