"""Warm spares: rank processes started ahead of time, with Python and torch imported.

Runs in the kernel: the pool is taken from and refilled on the cell's thread, the run's own and the
standby thread (launch/local/standby.py), under one lock; the spares themselves are processes
(rank/spare.py).

After a taas cell (and on ``%taas warm N``) the kernel keeps N spares. The next cell takes
them instead of starting fresh processes, so it skips the interpreter start and the torch
imports (about a second each here, 3 to 4 s with a CUDA build of torch). A spare is taken
once: every cell still gets fresh processes, no state passes from one cell to the next.
What a spare imported with does not count: it adopts the launch's environment and
working directory when taken (rank/spare.py), and the write rule is applied after that.

**Warm means warm.** A spare still warming up is never thrown away for a fresh process
that would have to do the same imports: the cell takes it and the rank simply connects
when its warm-up ends (the handshake waits in its stdin). A cell that needs more ranks
than there are spares takes every spare that fits and starts only the rest fresh.

**Bound to a GPU.** What a spare fixes before CUDA starts is its :class:`Binding`: the GPU
it is bound to and the ``CUDA_VISIBLE_DEVICES`` it sets in itself first. On a host with
GPUs, spare ``k`` is bound to GPU ``k`` while it waits (``torch.cuda.set_device(k)``, its
CUDA context made and a first CUDA step taken), so it serves only rank ``k`` of a cell on
the GPUs. That costs each spare its CUDA context in GPU memory (``%taas status`` shows it
where ``nvidia-smi`` can tell). On such a host a CPU spare starts with
``CUDA_VISIBLE_DEVICES=""``: it serves only ``--device cpu`` ranks, which must see no GPU,
and its warm-up (an optimizer's first step asks whether CUDA is there) would otherwise start
the CUDA driver with the GPUs in view, for good. A search's trials side by side each see
only their own slice of the GPUs (``CUDA_VISIBLE_DEVICES=2,3``, so ``LOCAL_RANK`` indexes
the slice): rank ``j`` of the trial on a slice is served by a spare that set that slice
before CUDA started and is bound to its GPU ``j`` (:func:`slice_bindings`).

What CUDA and torch read once at start-up (``CUDA_VISIBLE_DEVICES``, ``PYTORCH_CUDA_ALLOC_CONF``,
``CUBLAS_WORKSPACE_CONFIG``, ...: every ``CUDA_*``, ``PYTORCH_*``, ``CUBLAS_*`` and ``TORCH_*``
variable) is fixed in a spare when it imports: a spare serves a launch only while the
kernel's values of those are the ones it started under.

**Torch's compiler.** Once a cell's ranks compiled (``torch.compile``: the session's compile cache has
entries, compilecache/folder.py), a second factory imports Dynamo and Inductor and probes the CPU for
them, beside the one that serves; when ready it serves instead, and the spares the old one forked are
replaced by its forks, so a compiled cell in fresh ranks pays only what the cache does not hold.

Spares die with the kernel: a spare blocks reading its stdin, whose write end only the
kernel holds, and exits at end-of-file. ``%taas warm off`` and unloading the extension
stop them at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Sequence

from taas_magic.launch.local.factories import SINGLE_THREADED, Factories, frozen_settings
from taas_magic.launch.local.sparefactory import SpareFactory
from taas_magic.launch.rankenv import CPU, Binding, slice_visible, visible_gpu_count
from taas_magic.procs import Process, reap, signal_group
from taas_magic.rank.spare import WAITING_NAME

SPARE_COMMAND = (sys.executable, "-m", "taas_magic.rank", "--spare")
@dataclass
class Spare:
    """One waiting (or still warming) spare: its process, its :class:`Binding`, and the kernel's
    :func:`frozen_settings` when it started (its GPU is a device of that ``CUDA_VISIBLE_DEVICES``,
    or of its binding's own)."""

    process: Process  # a fork of the factory, or a fresh interpreter while the factory still imports
    binding: Binding
    settings: dict[str, str]
    compiler: bool = False  # forked from a factory that warmed torch's compiler (the session compiles)

    @property
    def gpu(self) -> int | None:
        return self.binding.gpu

    def serves(self, binding: Binding) -> bool:
        """Whether this spare can be the process of a rank that wants ``binding``."""
        return self.binding == binding and self.settings == frozen_settings()

    @property
    def ready(self) -> bool:
        """A spare names itself ``taas-spare`` once warm (rank/spare.py)."""
        try:
            with open(f"/proc/{self.process.pid}/comm", "rb") as comm:
                return comm.read().strip() == WAITING_NAME
        except OSError:
            return False


def proportional_bytes(pid: int) -> int:
    """A process's proportional set size (its private pages, and its share of the shared ones);
    its resident size where /proc has no smaps_rollup; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def gpu_bytes(spares: Sequence[Spare]) -> int | None:
    """GPU memory ``spares`` (the GPU-bound ones) hold, their CUDA contexts, from ``nvidia-smi``;
    None where it cannot tell (no nvidia-smi, or a PID namespace that hides the processes)."""
    pids = {spare.process.pid for spare in spares}
    if not pids:
        return 0
    try:
        listing = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    used: dict[int, int] = {}
    for line in listing.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            used[int(pid)] = used.get(int(pid), 0) + int(mib) * 2**20
    return sum(used[pid] for pid in pids) if pids <= set(used) else None


def bindings(count: int, gpus: int, host_gpus: int = 0) -> list[Binding]:
    """What rank ``k``'s spare is bound to: GPU ``k`` while ``k < gpus``, else the CPU (seeing
    none of the host's ``host_gpus``)."""
    cpu = Binding(None, "") if host_gpus else CPU
    return [Binding(rank) if rank < gpus else cpu for rank in range(count)]


def slice_bindings(gpu_ids: Sequence[str], size: int, slices: int) -> list[Binding]:
    """The spares of ``slices`` trials side by side, each on its own ``size`` GPUs of ``gpu_ids``
    (the kernel's, as ``CUDA_VISIBLE_DEVICES`` names them): rank ``j`` of the trial on slice
    ``s`` sees GPUs ``gpu_ids[s*size:(s+1)*size]`` and is bound to the ``j``-th of them."""
    return [Binding(rank, slice_visible(gpu_ids, size, index))
            for index in range(slices) for rank in range(size)]


class SparePool:
    """The kernel's warm spares. Runs on threads of their own take and refill it at the same
    time (a search's trials side by side, a detached run beside a cell): one lock around each
    public operation, so a spare is never handed to two runs and the factory forks one at a time."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.spares: list[Spare] = []
        self.factories = Factories()  # the one that forks spares, the compiler's coming one, the retired ones

    @property
    def factory(self) -> SpareFactory | None:
        """The factory that forks the spares once it has imported (launch/local/sparefactory.py)."""
        return self.factories.current

    @factory.setter
    def factory(self, factory: SpareFactory | None) -> None:
        self.factories.current = factory

    def take(self, wanted: Sequence[Binding]) -> list[Process | None]:
        """For each rank (wanting ``wanted[k]``), a spare that serves it, ready ones first, still
        warming ones next, then a fork of the factory (waiting for it while it imports); None
        where there is none (start that rank fresh). A warming spare, and a factory still
        importing, are waited for rather than passed over: they are ahead of any fresh process."""
        with self._lock:
            self._promote()
            self._drop_dead()
            by_readiness = sorted(self.spares, key=lambda spare: not spare.ready)
            taken: list[Process | None] = []
            for binding in wanted:
                match = next((spare for spare in by_readiness if spare.serves(binding)), None)
                if match is not None:
                    by_readiness.remove(match)
                    self.spares.remove(match)
                taken.append(match.process if match is not None else None)
            factory = self.factories.serving()
            for rank, binding in enumerate(wanted):
                if taken[rank] is None and factory is not None:
                    taken[rank] = factory.spawn(binding, for_cell=True)
            return taken

    def prepare(self) -> None:
        """Start the factory now (the extension loads), so that the kernel's first cell forks its
        ranks from it instead of starting fresh interpreters: by the time a person has written
        a cell its imports are done, and even a cell sent at once waits only for what is left
        of one import, not for one import per rank side by side."""
        with self._lock:
            self.factories.for_spares(step=visible_gpu_count() == 0)

    def fill(self, wanted: Sequence[Binding], host_gpus: int = 0) -> None:
        """Keep exactly the spares ranks wanting ``wanted`` would take (on a host with ``host_gpus``
        GPUs); spares that serve none of them are stopped."""
        with self._lock:
            self._promote()
            self._drop_dead()
            keep: list[Spare] = []
            missing: list[Binding] = []
            spare_list = list(self.spares)
            for binding in wanted:
                match = next((spare for spare in spare_list if spare.serves(binding)), None)
                if match is None:
                    missing.append(binding)
                else:
                    spare_list.remove(match)
                    keep.append(match)
            _stop([spare.process for spare in spare_list])
            self.spares = keep
            factory = self.factories.for_spares(step=host_gpus == 0) if missing else None
            for binding in missing:
                spare = _fork(factory, binding) or _start(binding)
                if spare is None:
                    return  # the next cell starts fresh processes instead
                self.spares.append(spare)

    def keep(self, count: int) -> None:
        """``%taas warm N`` (and ``TaasMagics.warm`` at start): the spares ranks ``0..count-1`` of
        a cell on this host's GPUs would take (CPU spares where it has none)."""
        gpus = visible_gpu_count()
        self.fill(bindings(count, gpus, gpus), gpus)

    def compiles(self) -> None:
        """A cell's ranks compiled (``torch.compile``): from now on spares are forks of a factory that has
        imported torch's compiler and probed the CPU for it, so a compiled cell in fresh ranks pays only
        what the session's compile cache does not hold (launch/local/factories.py). Once a session."""
        with self._lock:
            self.factories.compiles()

    def _promote(self) -> None:
        """The compiler's factory serves once it is ready: the old one's spares are replaced by its forks."""
        if self.factories.promote():
            _stop([spare.process for spare in self.spares if not spare.compiler])
            self.spares = [spare for spare in self.spares if spare.compiler]

    def forks_ready(self) -> bool:
        """Whether a spare started now is a fork of a ready factory (milliseconds), not a fresh interpreter."""
        return self.factories.forks_ready()

    def resident_bytes(self) -> int:
        """What keeping the spares costs in memory: theirs and the factory's, each process's
        proportional share (a forked spare shares the factory's pages; /proc's PSS splits them)."""
        processes = [spare.process.pid for spare in self.spares] + self.factories.pids()
        return sum(proportional_bytes(pid) for pid in processes)

    def describe(self, setting: str) -> str:
        """``%taas status``'s line: the ``warm`` setting, the spares waiting, their memory, the
        factory's state, and what the GPU-bound ones hold on their GPUs (their CUDA contexts)."""
        factory = self.factories.state()
        bound = [spare for spare in self.spares if spare.gpu is not None]
        return (f"warm spares: {setting}, {len(self.spares)} waiting, {self.resident_bytes() / 2**20:.0f} MB resident"
                f"{factory} (proportional: shared pages split)" + _held_on_gpus(bound))

    def close(self, wait: float = 1.0) -> None:
        """Stop the waiting spares; the factory retires (it leaves once what it forked has ended),
        and the retired factories that leave within ``wait`` seconds are reaped (a later fill or
        close reaps the others: a factory still importing, or whose fork is a cell's running rank)."""
        with self._lock:
            _stop([spare.process for spare in self.spares])
            self.spares = []
            self.factories.close(wait)  # their factory leaves now, unless a cell's rank still runs

    def _drop_dead(self) -> None:
        _stop([spare.process for spare in self.spares if spare.process.poll() is not None])
        self.spares = [spare for spare in self.spares if spare.process.poll() is None]


def _held_on_gpus(bound: list[Spare]) -> str:
    """What GPU-bound spares hold on their GPUs (their CUDA contexts), as ``%taas status`` says it."""
    if not bound:
        return ""
    held = gpu_bytes(bound)
    amount = f"{held / 2**20:.0f} MiB" if held is not None else "GPU memory unknown (nvidia-smi cannot see them)"
    return f"; {len(bound)} bound to GPU(s) {', '.join(_gpu_name(s.binding) for s in bound)}, {amount} on the GPUs"


def _gpu_name(binding: Binding) -> str:
    """A spare's GPU as the person reads it: its index, or for a search trial's slice, which of that slice."""
    return str(binding.gpu) if binding.visible is None else f"{binding.gpu} of {binding.visible}"


def _fork(factory: SpareFactory | None, binding: Binding) -> Spare | None:
    """A spare forked by ``factory`` (None while it imports, or where there is none)."""
    if factory is None:
        return None
    forked = factory.spawn(binding)
    return Spare(forked, binding, factory.settings, factory.compiler) if forked is not None else None


def _start(binding: Binding) -> Spare | None:
    """A spare as a fresh interpreter (the factory is still importing, or could not start)."""
    command = SPARE_COMMAND if binding.gpu is None else (*SPARE_COMMAND, "--gpu", str(binding.gpu))
    env = {**os.environ, **SINGLE_THREADED}
    if binding.visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = binding.visible  # what CUDA will see, fixed before it starts
    try:
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, cwd=os.getcwd(), start_new_session=True, close_fds=True,
        )
    except OSError:
        return None
    return Spare(process, binding, frozen_settings())


def _stop(processes: list[Process]) -> None:
    """Kill at once: a waiting spare holds nothing worth a graceful stop."""
    for process in processes:
        signal_group(process.pid, signal.SIGKILL)
    for process in processes:
        reap(process)
