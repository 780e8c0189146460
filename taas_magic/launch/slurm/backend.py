"""The Slurm engine's backend: a run on the held allocation, each attempt one ``srun`` step (launch/slurm/step.py).

Runs in the kernel: made on the cell's thread, each attempt's step started on the run's own thread.
The allocation is the session's (launch/slurm/allocation.py): a run holds nothing of its own
beyond its steps, so a cell pays Slurm's queue never, only a step's start. ``--gpus N`` asks
for N tasks with one GPU each (``--gpus-per-task=1``) on the fewest of the allocation's nodes
that hold them (``--nodes``: Slurm would otherwise spread them one per node), and Slurm
places them. An allocation without GPUs runs its ranks as CPU tasks with gloo. A node a run
found lost (its tasks ended without reporting their ranks, or the controller says it is down) is left out
of every later step (``--exclude``); ``--restarts`` continues on the nodes left while they
have the GPUs.
"""

from __future__ import annotations

import os
import socket
from types import TracebackType
from typing import Callable

from taas_magic.errors import LaunchError
from taas_magic.launch.contract import WORKER_COMMAND, DevicePlan, LaunchPlan, ProcessGroup, Say
from taas_magic.launch.placement import RankSlot
from taas_magic.launch.rankenv import CLUSTER_CPU
from taas_magic.launch.slurm.allocation import Allocation
from taas_magic.launch.slurm.courier import SlurmCourier
from taas_magic.launch.slurm.step import SlurmStep, StepTarget, fewest_nodes

ADDRESS_VARIABLE = "TAAS_SLURM_ADDRESS"  # where the nodes reach this kernel, when the route to them does not say


def kernel_address(node_address: str) -> str:
    """This host's address on the route to a node: where the step's tasks and ranks connect back."""
    given = os.environ.get(ADDRESS_VARIABLE, "").strip()
    if given:
        return given
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((node_address, 9))  # UDP: nothing is sent, the kernel only picks the route
        return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


class SlurmBackend:
    """Ranks are the tasks of one srun step per attempt, in the session's allocation."""

    memory_files = False  # a file in this host's /dev/shm reaches no other node: bytes go in the frames
    loopback_only = False
    replaces_ranks = True

    def __init__(self, allocation: Allocation, gpus: int):
        self._allocation = allocation
        allocation.refresh()
        usable = allocation.usable_nodes()
        self._gpus = allocation.info.gpus_total > 0
        have = self._capacity(usable)
        unit = "GPU" if self._gpus else "CPU"
        if gpus > have:
            left_out = sorted(set(allocation.info.nodes) - set(usable))
            lost = f"; left out: {', '.join(left_out)}" if left_out else ""
            raise LaunchError(f"taas: --gpus {gpus} cannot be placed: Slurm job {allocation.job_id} has {have} {unit}(s) on "
                              f"its usable nodes ({', '.join(usable) or 'none'}{lost}); ask for fewer, or "
                              "%taas cluster slurm again with more")
        self.devices = DevicePlan("cuda", gpus, "nccl") if self._gpus and allocation.has_cuda else CLUSTER_CPU
        self.slots = [RankSlot(rank, 0, 1, 0) for rank in range(gpus)]  # Slurm places the tasks: the step says where
        self.listen_host = kernel_address(allocation.node_address)
        self._usable = usable
        self._step: SlurmStep | None = None
        self._workers: SlurmStep | None = None

    def _capacity(self, nodes: list[str]) -> int:
        """How many ranks ``nodes`` hold: their GPUs, or their CPUs in an allocation without GPUs."""
        info = self._allocation.info
        return sum((info.gpus if self._gpus else info.cpus)[node] for node in nodes)

    def layout(self) -> str:
        nodes = ", ".join(self._usable)
        return (f"cluster: Slurm job {self._allocation.job_id}, {len(self.slots)} rank(s) as one srun step on its "
                f"nodes {nodes} (Slurm places them)")

    def master(self) -> tuple[str, int]:
        return "", 0  # task 0's node and port: the step fills them in from its tasks' answers

    def rank_extra_env(self, rank: int) -> dict[str, str]:
        return {}  # CUDA_VISIBLE_DEVICES: Slurm's binding, in the step

    def _target(self, ranks: bool) -> StepTarget:
        """The ranks' step: packed on the fewest usable nodes that hold them, each task its GPU and its
        share of the node's CPUs. The data workers': a CPU each, anywhere in the allocation (a Slurm
        job that holds GPUs holds no CPU-only node: mixing them takes a heterogeneous job)."""
        info = self._allocation.info
        left_out = tuple(node for node in info.nodes if node not in self._usable)
        if not ranks:
            return StepTarget(self._allocation.job_id, self.listen_host, False, exclude=left_out)
        if self._gpus:
            capacity = [info.gpus[node] for node in self._usable]
            cpus = min((info.cpus[node] // info.gpus[node] for node in self._usable if info.gpus[node]), default=1)
        else:
            capacity, cpus = [info.cpus[node] for node in self._usable], 1
        return StepTarget(self._allocation.job_id, self.listen_host, self._gpus, fewest_nodes(capacity, len(self.slots)),
                          max(1, cpus), left_out)

    def start_ranks(self, plan: LaunchPlan, key: bytes, stop_asked: Callable[[], bool] = lambda: False) -> ProcessGroup:
        self._step = SlurmStep.start(self._target(ranks=True), plan, key, stop_asked=stop_asked)
        return self._step

    def start_workers(self, plan: LaunchPlan, key: bytes, dirs: tuple[str, ...]) -> ProcessGroup:
        self._workers = SlurmStep.start(self._target(ranks=False), plan, key, WORKER_COMMAND, dirs)
        return self._workers

    def courier(self, cache_ram: int, say: Say) -> SlurmCourier:
        assert self._workers is not None, "start_workers first"
        return SlurmCourier(lambda: self._step, self._workers, cache_ram, say)

    def workers_layout(self) -> str | None:
        assert self._workers is not None, "start_workers first"
        return "taas: data workers as Slurm tasks on " + _spans(self._workers.nodes(), "worker")

    def standby(self, may_restart: bool) -> None:
        pass  # nothing waits on a node between steps: a restart is a new step

    def recover(self, say: Say) -> None:
        """Before a restart: the nodes the last step lost, and those the controller says are down,
        are left out from now on; the next step runs on the nodes left, if they have the GPUs."""
        allocation = self._allocation
        vanished = self._step.vanished_nodes() if self._step is not None else []
        allocation.lost.update(vanished)
        usable = allocation.usable_nodes()
        gone = [node for node in self._usable if node not in usable]
        if not gone:
            return
        self._usable = usable
        have = self._capacity(usable)
        say(f"taas: node {', '.join(gone)} of Slurm job {allocation.job_id} went away; the next attempt runs on the "
            f"nodes left ({', '.join(usable) or 'none'})")
        if have < len(self.slots):
            raise LaunchError(f"taas: node {', '.join(gone)} went away and the nodes left of Slurm job {allocation.job_id} "
                              f"have {have} of the {len(self.slots)} GPU(s) the run needs; nothing was restarted. A node "
                              "found lost stays left out of this allocation: %taas cluster off, then %taas cluster slurm "
                              "... for a new one")

    def release(self) -> None:
        pass  # the session holds the allocation; each step is closed by the run

    def __enter__(self) -> "SlurmBackend":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.release()


def _spans(nodes: list[str], what: str) -> str:
    """``ranks 0-1 on node1, rank 2 on node2`` from each one's node, by index."""
    spans: list[tuple[int, int, str]] = []
    for index, node in enumerate(nodes):
        if spans and spans[-1][2] == node and spans[-1][1] == index - 1:
            spans[-1] = (spans[-1][0], index, node)
        else:
            spans.append((index, index, node))
    return ", ".join(f"{what}s {a}-{b} on {node}" if a != b else f"{what} {a} on {node}" for a, b, node in spans)
