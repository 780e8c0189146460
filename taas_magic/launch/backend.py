"""Where a run's processes live: this host (:class:`LocalBackend`) or a Ray cluster (:class:`ClusterBackend`).

The magic picks one backend per cell and from then on asks only this contract; nothing
above it (magics.py, supervisor.py) asks which one is in use. A backend answers:

- the placement: the device plan and one :class:`RankSlot` per rank (decided when the
  backend is made: a cluster's GPUs are held from then on, or it raises and holds none);
- where the kernel listens and where rank 0's rendezvous is (``master``);
- whether the ranks share this host's ``/dev/shm`` (memory files), and the environment
  a rank needs beyond torchrun's (a cluster host's ``CUDA_VISIBLE_DEVICES``);
- starting the ranks and the data workers (the cluster mode carries elements between
  hosts with a courier);
- releasing everything when the cell ends (the reserved port, the agents and the
  placement group; a local backend refills the warm spares). A backend is a context
  manager: leaving it releases it (kernel/runs/run.py holds it so).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Callable, Optional, Protocol, TypeVar

from taas_magic.errors import LaunchError
from taas_magic.launch.base import LaunchPlan, ProcessGroup
from taas_magic.launch.local import LocalProcessGroup
from taas_magic.launch.placement import Node, RankSlot
from taas_magic.launch.rankenv import (
    LOOPBACK,
    Binding,
    DevicePlan,
    Rendezvous,
    idle_cores,
    plan_devices,
    rank_environment,
    reserve_port,
    slice_visible,
    visible_gpu_ids,
)
from taas_magic.launch.spares import SparePool, bindings, slice_bindings
from taas_magic.launch.standby import NEXT_CELL_DELAY, Standby

if TYPE_CHECKING:
    from taas_magic.launch.ray import ClusterLaunch

PlaneT = TypeVar("PlaneT")  # what starting the data workers makes (kernel/supervision/dataplane.py's DataPlane)
WorkerLaunch = Callable[[LaunchPlan, "tuple[str, ...]"], ProcessGroup]  # starts the workers elsewhere, given their cache folders
# DataRun.start with the workers' plan and the publisher bound: (launch, courier) -> the data plane
StartData = Callable[[Optional[WorkerLaunch], Optional[Callable[[], object]]], PlaneT]
Say = Callable[[str], None]  # a line of taas's own into the run's log (output/runlog.py)


class ClusterView(Protocol):
    """What placing ranks asks of an attached cluster (launch/attachment.py's Cluster)."""

    @property
    def ray(self) -> object: ...

    def nodes(self) -> list[Node]: ...

# A cluster whose GPUs are declared Ray resources without CUDA devices (a CPU test cluster).
CLUSTER_CPU = DevicePlan("cpu", 0, "gloo")


class Backend(Protocol):
    devices: DevicePlan
    slots: list[RankSlot]
    listen_host: str  # where the kernel's rank server listens
    memory_files: bool  # the ranks share this host's /dev/shm
    loopback_only: bool  # every rank runs on this host

    def layout(self) -> str | None:
        """A header line saying where the ranks run, or None when that is this host."""

    def master(self) -> tuple[str, int]:
        """MASTER_ADDR and MASTER_PORT for the ranks' rendezvous."""

    def rank_extra_env(self, rank: int) -> dict[str, str]:
        """Environment rank ``rank`` needs beyond torchrun's."""

    def start_ranks(self, plan: LaunchPlan, key: bytes, stop_asked: Callable[[], bool] = lambda: False) -> ProcessGroup:
        """Start the ranks of ``plan`` (``stop_asked``: an interrupt while they start, for a start that waits)."""

    def start_data(self, cache_ram: int, start: StartData[PlaneT], key: bytes, say: Say) -> PlaneT:
        """Start the data workers through ``start`` (DataRun.start with their plan bound);
        ``cache_ram`` bounds what another host keeps of their elements; where they run is said with ``say``."""

    def standby(self, may_restart: bool) -> None:
        """Every rank of an attempt connected: ready what may come next while it runs (the
        restart's processes when ``may_restart``, --restarts; perhaps the next cell's)."""

    def recover(self, say: Say) -> None:
        """Before a restart: where a host of the run went away, place its ranks elsewhere
        (then ``master`` and ``slots`` may have changed: environments are made again), and ``say`` so."""

    def release(self) -> None:
        """Whatever happened: give back what the run held (idempotent: the run releases as soon
        as its ranks are gone, the cell again whatever happened)."""

    def __enter__(self) -> "Backend": ...

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """:meth:`release`."""


@dataclass(frozen=True)
class GpuSlice:
    """A search's trial side by side with others on this host's GPUs: slice ``index`` of
    ``count``, each of the run's ``--gpus`` GPUs (kernel/trials/searchplan.py)."""

    index: int
    count: int


class LocalBackend:
    """Ranks are processes on this host (from warm spares when there are enough)."""

    listen_host = LOOPBACK
    memory_files = True
    loopback_only = True

    def __init__(self, gpus: int, spares: SparePool | None, refill: Callable[[], int] | None, device: str = "auto",
                 gpu_slice: GpuSlice | None = None):
        self.devices = plan_devices(gpus, device=device)  # raises LaunchError (nothing held): too few GPUs, or none
        self.slots = [RankSlot(rank, rank, gpus, 0) for rank in range(gpus)]
        self._spares, self._refill = spares, refill
        # a search's trial on a slice of the GPUs: its ranks see only those (CUDA_VISIBLE_DEVICES),
        # so LOCAL_RANK indexes the slice; its spares set the same slice before CUDA starts
        self._slice = gpu_slice if self.devices.device == "cuda" else None
        self._gpu_ids = visible_gpu_ids() if self._slice is not None else []
        self._visible: str | None = None
        if self._slice is not None:
            needed = self._slice.count * gpus
            if needed > len(self._gpu_ids):
                raise LaunchError(f"taas: {self._slice.count} trial(s) of {gpus} GPU(s) side by side need {needed} "
                                  f"GPUs; this host shows the kernel {len(self._gpu_ids)}")
            self._visible = slice_visible(self._gpu_ids, gpus, self._slice.index)
        self._port = reserve_port()  # held until the run ends, so two notebooks cannot clash
        self._standby = Standby()  # spares warmed during the run, off the supervisor's thread

    def layout(self) -> str | None:
        return None

    def master(self) -> tuple[str, int]:
        return LOOPBACK, self._port.getsockname()[1]

    def rank_extra_env(self, rank: int) -> dict[str, str]:
        if self._visible is not None:
            return {"CUDA_VISIBLE_DEVICES": self._visible}
        # --device cpu on a GPU host: the ranks (and what the cell starts) see no GPU at all
        return {"CUDA_VISIBLE_DEVICES": ""} if self.devices.hides_gpus else {}

    def start_ranks(self, plan: LaunchPlan, key: bytes, stop_asked: Callable[[], bool] = lambda: False) -> ProcessGroup:
        self._standby.settle()  # a restart takes the spares standby made for it
        return LocalProcessGroup.start(plan, spares=self._spares, wanted=self._own())

    def start_data(self, cache_ram: int, start: StartData[PlaneT], key: bytes, say: Say) -> PlaneT:
        return start(None, None)

    def standby(self, may_restart: bool) -> None:
        """Warm spares while the attempt runs: for its restart (--restarts), and for the next cell
        (or a search's next trial, which then starts the moment this one's ranks are gone) when
        that costs the ranks nothing: CPU spares forked from a ready factory (milliseconds each, no
        import, no step), or the ranks leave most of the host's cores idle (a GPU host's ranks
        compute on their GPUs: a spare there takes seconds to warm, which a cell rerun a second
        later would wait for). A GPU spare is never made beside ranks that leave no core idle:
        its CUDA context would take GPU memory the training may need. Off the supervisor's thread,
        and the next cell's a moment into the run (launch/standby.py)."""
        if self._spares is None or self._standby.busy:
            return
        forked_cpu = self.devices.device != "cuda" and self._spares.forks_ready()
        side_by_side = self._slice.count if self._slice is not None else 1  # a search's other trials compute too
        idle = idle_cores(len(self.slots) * side_by_side)
        if may_restart:
            self._standby.start(functools.partial(self._fill, _union(self._own(), self._next())), 0)
        elif self._refill is not None and (idle or forked_cpu):  # forks beside busy ranks: a moment later
            self._standby.start(functools.partial(self._fill, self._next()), 0 if idle else NEXT_CELL_DELAY)

    def _own(self) -> list[Binding]:
        """What this run's ranks take: rank k's spare bound to GPU k (of its slice), or CPU spares."""
        if self._visible is not None:
            return [Binding(rank, self._visible) for rank in range(len(self.slots))]
        return self._bindings(len(self.slots))

    def _next(self) -> list[Binding]:
        """The spares to keep for what comes next (the session's ``warm``): the next cell's ranks,
        or for a search's trials side by side, every slice's ranks."""
        count = self._refill() if self._refill is not None else 0
        if self._slice is not None:
            return slice_bindings(self._gpu_ids, len(self.slots), self._slice.count)[:count]
        return self._bindings(count)

    def _bindings(self, count: int) -> list[Binding]:
        on_host = self.devices.gpus_on_host
        return bindings(count, on_host if self.devices.device == "cuda" else 0, on_host)

    def _fill(self, wanted: list[Binding]) -> None:
        assert self._spares is not None
        self._spares.fill(wanted, self.devices.gpus_on_host)

    def recover(self, say: Say) -> None:
        pass  # this host is the kernel's: if it is gone, so is the run

    def release(self) -> None:
        if self._port.fileno() == -1:
            return  # released already
        self._port.close()
        self._standby.settle()
        if self._spares is not None and self._refill is not None:  # now that this cell no longer needs the CPU
            self._fill(self._next())

    def __enter__(self) -> "LocalBackend":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


class ClusterBackend:
    """Ranks are processes under one agent per host of a Ray cluster (launch/ray.py)."""

    memory_files = False  # a file in this host's /dev/shm reaches no other host: bytes go in the frames
    loopback_only = False

    @classmethod
    def place(cls, cluster: ClusterView, gpus: int, per_host: int | None, wait: float) -> "ClusterBackend":
        """Plan which hosts run which ranks and hold their GPUs (within ``wait`` seconds);
        raises, holding nothing, when the cluster cannot (launch/placement.py, launch/ray.py)."""
        from taas_magic.launch.placement import plan_hosts
        from taas_magic.launch.ray import ClusterLaunch

        shares = plan_hosts(cluster.nodes(), gpus, per_host)
        return cls(ClusterLaunch(cluster.ray, shares, wait, cluster.nodes), (cluster, gpus, per_host, wait))

    def __init__(self, launch: "ClusterLaunch", request: tuple[ClusterView, int, int | None, float]):
        self._launch = launch  # a ClusterLaunch: the cluster's GPUs are held
        self._request = request  # (cluster, gpus, per_host, wait): to place again when a host is lost
        self.devices = DevicePlan("cuda", len(launch.slots), "nccl") if launch.has_cuda else CLUSTER_CPU
        self.slots = launch.slots
        self.listen_host = launch.kernel_address
        self._released = False

    def layout(self) -> str | None:
        return "cluster: " + self._launch.layout()

    def master(self) -> tuple[str, int]:
        return self._launch.master_addr, self._launch.master_port

    def rank_extra_env(self, rank: int) -> dict[str, str]:
        if self.devices.device != "cuda":
            return {}
        return {"CUDA_VISIBLE_DEVICES": self._launch.host_gpu_ids(rank)}  # LOCAL_RANK indexes the host's GPUs

    def start_ranks(self, plan: LaunchPlan, key: bytes, stop_asked: Callable[[], bool] = lambda: False) -> ProcessGroup:
        return self._launch.start(plan, key)

    def start_data(self, cache_ram: int, start: StartData[PlaneT], key: bytes, say: Say) -> PlaneT:
        launch = self._launch
        plane = start(lambda plan, dirs: launch.start_workers(plan, key, dirs), lambda: launch.courier(cache_ram))
        say(f"taas: data {launch.worker_layout}")
        return plane

    def standby(self, may_restart: bool) -> None:
        pass  # each host's agent starts its ranks again; the placement is held for the whole cell

    def recover(self, say: Say) -> None:
        from taas_magic.launch.placement import plan_hosts

        lost = self._launch.lost_hosts()
        if not lost:
            return
        cluster, gpus, per_host, wait = self._request
        say(f"taas: {', '.join(lost)} went away; placing the ranks on the cluster's free GPUs again "
            f"(waiting up to {wait:g} s, --place-timeout)")
        self._launch.replace(plan_hosts(cluster.nodes(), gpus, per_host), wait)  # raises LaunchError when it cannot
        self.slots = self._launch.slots
        say("taas: cluster: " + self._launch.layout())

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._launch.release()  # agents killed, GPUs given back

    def __enter__(self) -> "ClusterBackend":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


def rank_environments(backend: Backend, base: dict[str, str], run_id: str) -> list[dict[str, str]]:
    """Every rank's environment: torchrun's variables for its slot, and what the backend adds."""
    master_addr, master_port = backend.master()
    rendezvous = Rendezvous(master_addr, master_port, len(backend.slots), run_id)
    envs = []
    for slot in backend.slots:
        env = rank_environment(dict(base), slot, rendezvous, loopback_only=backend.loopback_only)
        env.update(backend.rank_extra_env(slot.rank))
        envs.append(env)
    return envs


def _union(first: list[Binding], second: list[Binding]) -> list[Binding]:
    """Both lists' bindings, each as many times as the list that has it most (CPU spares repeat)."""
    rest = list(first)
    merged = list(first)
    for binding in second:
        if binding in rest:
            rest.remove(binding)
        else:
            merged.append(binding)
    return merged
