"""The local engine's backend: a run's ranks and data workers are processes on this host.

Runs in the kernel: made on the cell's thread, started and released on the run's own thread. The
ranks come from the warm spares when there are enough (launch/local/spares.py), fresh processes
otherwise (launch/local/processes.py); the data workers are fresh processes, and they need no
courier: every rank maps their cache. While a run goes, spares for its restart and for the next
cell are warmed off the supervisor's thread (launch/local/standby.py).
"""

from __future__ import annotations

import functools
from types import TracebackType
from typing import Callable

from taas_magic.errors import LaunchError
from taas_magic.launch.contract import WORKER_COMMAND, Courier, GpuSlice, LaunchPlan, ProcessGroup, Say
from taas_magic.launch.local.processes import LocalProcessGroup
from taas_magic.launch.local.spares import SparePool, bindings, slice_bindings
from taas_magic.launch.local.standby import NEXT_CELL_DELAY, Standby
from taas_magic.launch.placement import RankSlot
from taas_magic.launch.rankenv import (
    Binding,
    idle_cores,
    plan_devices,
    slice_visible,
    visible_gpu_ids,
)
from taas_magic.wire import LOOPBACK, PortReservation


class LocalBackend:
    """Ranks are processes on this host (from warm spares when there are enough)."""

    listen_host = LOOPBACK
    memory_files = True
    loopback_only = True
    replaces_ranks = True

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
        self._port = PortReservation()  # held until the run ends, so two notebooks cannot clash
        self._standby = Standby()  # spares warmed during the run, off the supervisor's thread

    def layout(self) -> str | None:
        return None

    def master(self) -> tuple[str, int]:
        return LOOPBACK, self._port.port

    def rank_extra_env(self, rank: int) -> dict[str, str]:
        if self._visible is not None:
            return {"CUDA_VISIBLE_DEVICES": self._visible}
        # --device cpu on a GPU host: the ranks (and what the cell starts) see no GPU at all
        return {"CUDA_VISIBLE_DEVICES": ""} if self.devices.hides_gpus else {}

    def start_ranks(self, plan: LaunchPlan, key: bytes, stop_asked: Callable[[], bool] = lambda: False) -> ProcessGroup:
        self._standby.settle()  # a restart takes the spares standby made for it
        return LocalProcessGroup.start(plan, spares=self._spares, wanted=self._own())

    def start_workers(self, plan: LaunchPlan, key: bytes, dirs: tuple[str, ...]) -> ProcessGroup:
        return LocalProcessGroup.start(plan, WORKER_COMMAND, "data worker")

    def courier(self, cache_ram: int, say: Say) -> Courier | None:
        return None  # every rank maps the workers' cache

    def workers_layout(self) -> str | None:
        return None

    def standby(self, may_restart: bool) -> None:
        """Warm spares while the attempt runs: for its restart (--restarts), and for the next cell
        (or a search's next trial, which then starts the moment this one's ranks are gone) when
        that costs the ranks nothing: CPU spares forked from a ready factory (milliseconds each, no
        import, no step), or the ranks leave most of the host's cores idle (a GPU host's ranks
        compute on their GPUs: a spare there takes seconds to warm, which a cell rerun a second
        later would wait for). A GPU spare is never made beside ranks that leave no core idle:
        its CUDA context would take GPU memory the training may need. Off the supervisor's thread,
        and the next cell's a moment into the run (launch/local/standby.py)."""
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
        if self._port.closed:
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
