"""The Ray engine's backend: a run's ranks under one agent per host of a Ray cluster.

Runs in the kernel: placed on the cell's thread, started and released on the run's own thread.
:meth:`RayBackend.place` plans which hosts run which ranks (launch/placement.py) and holds their
GPUs (launch/ray/processes.py's :class:`RayLaunch`); the data workers run on the cluster's CPU
hosts, and a :class:`RayCourier` carries their elements to the ranks' hosts.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Callable

from taas_magic.launch.contract import DevicePlan, LaunchPlan, ProcessGroup, Say
from taas_magic.launch.placement import Node, plan_hosts
from taas_magic.launch.rankenv import CLUSTER_CPU
from taas_magic.launch.ray.courier import RayCourier
from taas_magic.launch.ray.processes import RayLaunch


class RayBackend:
    """Ranks are processes under one agent per host of a Ray cluster (launch/ray/processes.py)."""

    memory_files = False  # a file in this host's /dev/shm reaches no other host: bytes go in the frames
    loopback_only = False
    replaces_ranks = True

    @classmethod
    def place(cls, ray: Any, nodes: Callable[[], list[Node]], gpus: int, per_host: int | None,
              wait: float) -> "RayBackend":
        """Plan which hosts of the cluster (``nodes()``: its nodes now) run which ranks and hold their
        GPUs (within ``wait`` seconds); raises, holding nothing, when the cluster cannot
        (launch/placement.py, launch/ray/processes.py)."""
        shares = plan_hosts(nodes(), gpus, per_host)
        return cls(RayLaunch(ray, shares, wait, nodes), (nodes, gpus, per_host, wait))

    def __init__(self, launch: RayLaunch, request: tuple[Callable[[], list[Node]], int, int | None, float]):
        self._launch = launch  # the cluster's GPUs are held
        self._request = request  # (nodes, gpus, per_host, wait): to place again when a host is lost
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

    def start_workers(self, plan: LaunchPlan, key: bytes, dirs: tuple[str, ...]) -> ProcessGroup:
        return self._launch.start_workers(plan, key, dirs)

    def courier(self, cache_ram: int, say: Say) -> RayCourier:
        return self._launch.courier(cache_ram)

    def workers_layout(self) -> str | None:
        return f"taas: data {self._launch.worker_layout}"

    def standby(self, may_restart: bool) -> None:
        pass  # each host's agent starts its ranks again; the placement is held for the whole cell

    def recover(self, say: Say) -> None:
        lost = self._launch.lost_hosts()
        if not lost:
            return
        nodes, gpus, per_host, wait = self._request
        say(f"taas: {', '.join(lost)} went away; placing the ranks on the cluster's free GPUs again "
            f"(waiting up to {wait:g} s, --place-timeout)")
        self._launch.replace(plan_hosts(nodes(), gpus, per_host), wait)  # raises LaunchError when it cannot
        self.slots = self._launch.slots
        say("taas: cluster: " + self._launch.layout())

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._launch.release()  # agents killed, GPUs given back

    def __enter__(self) -> "RayBackend":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()
