"""The contract between the kernel and an engine: only protocols and values, no implementation.

Runs wherever it is imported: in the kernel, and on a cluster's host in a Ray host agent or a Slurm
task, which reads a :class:`LaunchPlan`. An engine is a package of launch/ (``local/``, ``ray/``,
``slurm/``) that implements these; launch/engines.py is the one place that names them. The kernel
holds an :class:`Attachment` (a cluster it attached with ``%taas cluster``) or none (this host),
asks it for a run's :class:`Backend`, gives the backend a :class:`LaunchPlan` and gets a
:class:`ProcessGroup` back: the ranks, or the data workers, as :class:`ChildProcess` es whose output
fds it reads and whose exit it polls. On a cluster the backend may give a :class:`Courier` that
carries prepared elements to the ranks' hosts. Nothing here calls back into the kernel (as torch's
``PContext`` and httpx's ``BaseTransport``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Callable, Mapping, Protocol, Sequence

from taas_magic.wire import Placement

if TYPE_CHECKING:
    from taas_magic.feed.coordinator import Send
    from taas_magic.launch.placement import Node, RankSlot

RANK_COMMAND = (sys.executable, "-m", "taas_magic.rank")  # what a rank runs, wherever it is started
WORKER_COMMAND = (sys.executable, "-m", "taas_magic.feed.worker")  # what a data worker runs
Say = Callable[[str], None]  # a line of taas's own into the run's log (output/runlog.py)
Show = Callable[[str], None]  # a line the cell shows and replaces (a queued allocation's state)


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start the ranks of one run."""

    world_size: int
    envs: Sequence[Mapping[str, str]]  # one environment per rank, index = RANK
    cwd: str
    handshake: str  # rank/startup.py's Handshake line, written on each rank's stdin (never in its environment)
    places: Sequence[Placement]  # each one's id, name and write rule, the next line on its stdin; index = RANK
    stack_files: Sequence[str] = field(default=())  # where each rank's autopsy lands (autopsy/dump.py), index = RANK

    def part(self, first: int, count: int) -> "LaunchPlan":
        """Ranks ``first`` .. ``first + count - 1`` of this plan (one host's share), renumbered from 0."""
        return LaunchPlan(count, self.envs[first:first + count], self.cwd, self.handshake,
                          self.places[first:first + count], self.stack_files[first:first + count])


@dataclass(frozen=True)
class DevicePlan:
    """Where the ranks compute: ``cuda`` (one GPU per rank, NCCL) or ``cpu`` (gloo).

    ``gpus_on_host`` is what the host offers; ``chosen`` is True when the person asked for
    the CPU (``--device cpu``) on a host that has GPUs: the ranks are then shown none.
    """

    device: str
    gpus_on_host: int
    backend: str
    chosen: bool = False

    @property
    def hides_gpus(self) -> bool:
        return self.device == "cpu" and self.gpus_on_host > 0

    @property
    def notice(self) -> str | None:
        if self.hides_gpus:
            return (f"--device cpu: ranks run on CPU with gloo and see none of this host's {self.gpus_on_host} GPU(s); "
                    "a request for nccl is served by gloo")
        if self.device == "cpu":
            return "no GPU on this host: ranks run on CPU, and a request for nccl is served by gloo"
        return None


class ChildProcess(Protocol):
    """One process a launcher started: a rank (``index`` = its RANK) or a data worker (its number)."""

    index: int
    stdout_fd: int
    stderr_fd: int
    exit_fd: int | None  # readable once the process has exited (a pidfd), or None: poll() is polled

    @property
    def host(self) -> str:
        """Where it runs, as a failure names it."""

    def poll(self) -> int | None:
        """The exit code once the process has exited (negative: killed by that signal)."""


class ProcessGroup(Protocol):
    @property
    def children(self) -> Sequence[ChildProcess]:
        """The processes, in ``index`` order."""

    def interrupt(self, ranks: Sequence[int]) -> None:
        """SIGINT now to each of those ranks' process groups (the rank and what its cell started), as a terminal's
        ^C: the cell's ``KeyboardInterrupt`` and its ``finally``. Returns at once; the caller watches them end (a
        cell's ranks, then :meth:`stop`). Kept ranks are interrupted by a frame instead, which names the cell it is
        for (kernel/supervision/keptcell.py): a signal that came late would interrupt the next cell."""

    def stop(self, graceful: bool = True) -> list[str]:
        """Stop every rank (INT -> TERM -> KILL; TERM -> KILL unless ``graceful``); return the signals it took."""

    def stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Each of those ranks' thread stacks, as stacks.take reads them (the hang autopsy)."""

    def replace(self, rank: int, plan: LaunchPlan) -> ChildProcess:
        """A new process in dead rank ``rank``'s place, started as ``plan`` starts that rank (a kept rank that
        died: the others keep theirs); raises LaunchError where the engine cannot (the ranks are then lost)."""

    def close(self) -> None:
        """Idempotent: stop what still runs, reap everything, release every fd."""

    def __enter__(self) -> "ProcessGroup": ...

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """:meth:`close`: a group is a context manager, closed on leaving it whatever happened."""


@dataclass(frozen=True)
class GpuSlice:
    """A search's trial side by side with others on this host's GPUs: slice ``index`` of
    ``count``, each of the run's ``--gpus`` GPUs (kernel/trials/searchplan.py)."""

    index: int
    count: int


class Courier(Protocol):
    """Carries prepared elements from the data workers' hosts to each rank's host (a cluster's
    backend makes one; on this host every process maps the workers' cache, and there is none)."""

    @property
    def busy(self) -> bool:
        """Copies are under way: the supervisor polls :meth:`ready` soon rather than waiting in select."""

    def route(self, sends: list[Send]) -> list[Send]:
        """The deliveries that may go now, their elements' addresses those on the rank's host;
        the others are held back until their copies are there."""

    def ready(self) -> list[Send]:
        """Held-back deliveries whose copies have arrived, in each rank's order."""

    def restart_ranks(self) -> None:
        """The ranks start again (--restarts): copies kept for the last attempt's hosts are stale."""


class Backend(Protocol):
    """Where one run's processes live, from the moment its resources are held until :meth:`release`.

    The kernel asks only this: the placement (the device plan and one :class:`RankSlot` per rank);
    where its rank server listens and where rank 0's rendezvous is; whether the ranks share this
    host's ``/dev/shm``; each rank's environment beyond torchrun's; starting the ranks, the data
    workers and their courier; readying what comes next; recovering a lost host; releasing. A
    backend is a context manager: leaving it releases it (kernel/runs/run.py holds it so).
    """

    devices: DevicePlan
    slots: list[RankSlot]
    listen_host: str  # where the kernel's rank server listens
    memory_files: bool  # the ranks share this host's /dev/shm
    loopback_only: bool  # every rank runs on this host
    replaces_ranks: bool  # a kept rank that died gets a new process in its place (ProcessGroup.replace)

    def layout(self) -> str | None:
        """A header line saying where the ranks run, or None when that is this host."""

    def master(self) -> tuple[str, int]:
        """MASTER_ADDR and MASTER_PORT for the ranks' rendezvous."""

    def rank_extra_env(self, rank: int) -> dict[str, str]:
        """Environment rank ``rank`` needs beyond torchrun's."""

    def start_ranks(self, plan: LaunchPlan, key: bytes, stop_asked: Callable[[], bool] = lambda: False) -> ProcessGroup:
        """Start the ranks of ``plan`` (``stop_asked``: an interrupt while they start, for a start that waits)."""

    def start_workers(self, plan: LaunchPlan, key: bytes, dirs: tuple[str, ...]) -> ProcessGroup:
        """Start the data workers of ``plan``; ``dirs``: their cache folders (RAM, disk), made
        already on this host, made by the engine where the workers run elsewhere."""

    def courier(self, cache_ram: int, say: Say) -> Courier | None:
        """Once the workers run: what carries their elements to the ranks' hosts (``cache_ram``
        bounds what a host keeps of them; ``say`` tells the cell when elements first travel),
        or None where the ranks map the workers' cache directly."""

    def workers_layout(self) -> str | None:
        """Once the workers run: a line saying where, or None when that is this host."""

    def standby(self, may_restart: bool) -> None:
        """Every rank of an attempt connected: ready what may come next while it runs (the
        restart's processes when ``may_restart``, --restarts; perhaps the next cell's)."""

    def recover(self, say: Say) -> None:
        """Before a restart: where a host of the run went away, place its ranks elsewhere
        (then ``master`` and ``slots`` may have changed: environments are made again), and ``say`` so."""

    def release(self) -> None:
        """Whatever happened: give back what the run held (idempotent: the run releases as soon
        as its ranks are gone, the cell again whatever happened)."""

    def __enter__(self) -> Backend: ...

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """:meth:`release`."""


class Attachment(Protocol):
    """A cluster the session is attached to (``%taas cluster``): its nodes, a run's backend on it,
    its status lines, and letting go of it. Without one, cells run on this host."""

    @property
    def attached(self) -> bool:
        """Still held: False once it let go, or once its engine let go of it for another
        (``ray.init`` for a new Ray cluster lets go of the last one)."""

    def nodes(self) -> list[Node]:
        """Alive nodes with their total and free GPUs and CPUs."""

    def place(self, gpus: int, per_host: int | None, wait: float) -> Backend:
        """A run's backend on the cluster, its resources held; raises LaunchError, holding nothing."""

    def status_lines(self) -> list[str]:
        """``%taas cluster`` and ``%taas status``: what is attached, its nodes and what is free."""

    def detach(self) -> None:
        """Let go of the cluster (idempotent)."""


class Spares(Protocol):
    """This host's warm spare ranks (``%taas warm``): processes with torch imported, waiting to
    become the next cell's ranks (launch/local/spares.py)."""

    def keep(self, count: int) -> None:
        """Keep ``count`` spares warm from now on."""

    def prepare(self) -> None:
        """Start what makes spares quick to make (the spare factory importing torch)."""

    def compiles(self) -> None:
        """The session's ranks compiled: spares come with torch's compiler warmed from now on."""

    def describe(self, setting: str) -> str:
        """``%taas status``'s line: the ``warm`` setting, the spares waiting, their memory and GPUs."""

    def close(self, wait: float = 1.0) -> None:
        """End every spare and the factory (waiting up to ``wait`` seconds for them to go)."""
