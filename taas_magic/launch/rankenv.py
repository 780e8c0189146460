"""The per-rank environment (torchrun's contract), ports, and the device plan.

Runs in the kernel (a run's plan step and its backend), and in a Ray host agent or Slurm task, which
counts its host's GPUs and reserves the rendezvous port.

Each rank gets, as ``torchrun`` sets them (see torch/distributed/run.py)::

    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
    MASTER_ADDR (127.0.0.1 locally), MASTER_PORT (free, reserved), TORCHELASTIC_RUN_ID

plus ``OMP_NUM_THREADS`` (the host's cores divided among its ranks) unless the person
set one, and, in the local mode, ``GLOO_SOCKET_IFNAME``/``TP_SOCKET_IFNAME`` pointing at
the loopback interface unless set. ``TORCHELASTIC_RUN_ID`` is what makes PyTorch
Lightning trust an external launcher instead of spawning its own processes.
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from taas_magic.errors import LaunchError
from taas_magic.launch.contract import Backend, DevicePlan
from taas_magic.launch.placement import RankSlot
from taas_magic.procs import cores, omp_threads

# A cluster whose GPUs are declared Ray resources without CUDA devices (a CPU test cluster), or a
# Slurm allocation without GPUs: its ranks compute on CPU with gloo.
CLUSTER_CPU = DevicePlan("cpu", 0, "gloo")


@dataclass(frozen=True)
class Binding:
    """What rank ``k``'s spare fixes before CUDA starts: the GPU it binds (``gpu``, an index into
    what it sees; None: a CPU rank) and the ``CUDA_VISIBLE_DEVICES`` it sets in itself first
    (``visible``; None: the kernel's own, "": no GPU, "2,3": a search trial's slice)."""

    gpu: int | None = None
    visible: str | None = None


CPU = Binding()


def slice_visible(gpu_ids: Sequence[str], size: int, index: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` of slice ``index`` of ``size`` GPUs: its entries of ``gpu_ids``."""
    return ",".join(gpu_ids[index * size:(index + 1) * size])


@dataclass(frozen=True)
class RankChoice:
    """How many ranks a cell runs, and, for ``--gpus auto``, why that many (the header says it)."""

    ranks: int
    why: str | None = None


AUTO_CPU_RANKS = 2  # --gpus auto without GPUs: two CPU ranks, so the cell still shows DDP


def visible_gpu_count() -> int:
    """GPUs this host offers the kernel, without creating a CUDA context in the kernel.

    Counts NVIDIA devices from /proc (no torch import, so the first cell does not pay
    for torch in the kernel), narrowed by CUDA_VISIBLE_DEVICES. If torch is already
    imported in the kernel, its (NVML-based) count is used instead.
    """
    override = os.environ.get("TAAS_VISIBLE_GPUS")
    if override is not None:
        return max(0, int(override))
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "cuda"):
        try:
            return int(torch.cuda.device_count())
        except Exception:  # noqa: BLE001 - a broken driver means no usable GPU
            return 0
    physical = len(glob.glob("/proc/driver/nvidia/gpus/*"))
    entries = _visible_entries()
    return physical if entries is None else min(len(entries), physical)


def _visible_entries() -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES``'s entries (None: unset; none where it hides every GPU, as a
    leading negative index does)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    return [] if entries and entries[0].startswith("-") else entries


def visible_gpu_ids() -> list[str]:
    """The kernel's GPUs as ``CUDA_VISIBLE_DEVICES`` names them (its entries: indices, UUIDs or
    MIG names), or ``0..n-1`` where it is unset: what a slice of them is shown as, so a trial on
    GPUs 2 and 3 of a kernel that sees ``4,5,6,7`` is shown ``6,7``."""
    count = visible_gpu_count()
    entries = _visible_entries()
    return [str(index) for index in range(count)] if entries is None else entries[:count]


def plan_devices(ranks: int, gpus_on_host: int | None = None, device: str = "auto") -> DevicePlan:
    """One GPU per rank with NCCL; CPU with gloo when the host has no GPU or ``device`` is ``cpu``.

    Raises:
        LaunchError: ``--device cuda`` on a host without GPUs, or a host with GPUs but fewer than ``ranks``.
    """
    gpus = visible_gpu_count() if gpus_on_host is None else gpus_on_host
    if device == "cpu":
        return DevicePlan("cpu", gpus, "gloo", chosen=True)
    if gpus == 0:
        if device == "cuda":
            raise LaunchError("taas: --device cuda, but this host has no GPU (none visible to the kernel); "
                              "leave --device out or use --device cpu to run the ranks on CPU")
        return DevicePlan("cpu", 0, "gloo")
    if gpus < ranks:
        raise LaunchError(
            f"taas: --gpus {ranks} asks for {ranks} ranks but this host has {gpus} GPU(s); "
            f"use --gpus {gpus}, --gpus auto or --device cpu, or attach a cluster"
        )
    return DevicePlan("cuda", gpus, "nccl")


def choose_ranks(gpus: int | str, device: str, count_gpus: Callable[[], int], where: str = "this host") -> RankChoice:
    """``--gpus N`` is N ranks; ``--gpus auto`` is one per GPU of ``where`` (``count_gpus()``, asked only
    then: as torchrun's ``--nproc-per-node auto``), or :data:`AUTO_CPU_RANKS` CPU ranks where there is none
    or ``device`` is ``cpu``."""
    if gpus != "auto":
        assert isinstance(gpus, int), "the grammar gives an int or auto"
        return RankChoice(gpus)
    if device == "cpu":
        return RankChoice(AUTO_CPU_RANKS, f"--gpus auto with --device cpu: {AUTO_CPU_RANKS} CPU ranks")
    gpus_on_host = count_gpus()
    if gpus_on_host == 0:
        if device == "cuda":  # plan_devices says why this cannot run
            return RankChoice(1)
        return RankChoice(AUTO_CPU_RANKS, f"--gpus auto: no GPU on {where}, so {AUTO_CPU_RANKS} CPU ranks to show DDP")
    return RankChoice(gpus_on_host, f"--gpus auto: one per GPU of {where}")


SPARE_CORES_PER_RANK = 4  # warm the next cell's spares during a run only where the ranks leave 3/4 of the cores idle


def idle_cores(ranks: int) -> bool:
    """Whether ``ranks`` local ranks leave most of this host's cores idle (a 16-core host with
    a GPU or two: yes; 2 CPU ranks on 2 cores: no), so warming spares beside them costs the run nothing."""
    return cores() >= SPARE_CORES_PER_RANK * max(1, ranks)


@dataclass(frozen=True)
class Rendezvous:
    """How the ranks of a run find one another, the same for every rank: rank 0's store at
    ``MASTER_ADDR:MASTER_PORT``, ``WORLD_SIZE`` ranks, the run's ``TORCHELASTIC_RUN_ID``."""

    master_addr: str
    master_port: int
    world_size: int
    run_id: str


def rank_environment(base: dict[str, str], slot: RankSlot, rendezvous: Rendezvous, *,
                     loopback_only: bool) -> dict[str, str]:
    """The environment of the rank in ``slot``: the kernel's environment plus torchrun's variables
    (``loopback_only``: every rank runs on this host, so gloo and tensorpipe use ``lo``)."""
    env = dict(base)
    env.update(
        RANK=str(slot.rank),
        LOCAL_RANK=str(slot.local_rank),
        WORLD_SIZE=str(rendezvous.world_size),
        LOCAL_WORLD_SIZE=str(slot.local_world_size),
        GROUP_RANK=str(slot.group_rank),
        ROLE_RANK=str(slot.rank),
        ROLE_WORLD_SIZE=str(rendezvous.world_size),
        MASTER_ADDR=rendezvous.master_addr,
        MASTER_PORT=str(rendezvous.master_port),
        TORCHELASTIC_RUN_ID=rendezvous.run_id,
    )
    env.setdefault("OMP_NUM_THREADS", str(omp_threads(slot.local_world_size)))
    if loopback_only:
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("TP_SOCKET_IFNAME", "lo")
    return env


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
