"""A spare rank: Python and torch imported ahead of time, waiting for a cell to take it.

Runs in a spare (``python -m taas_magic.rank --spare``, or a fork of the spare factory) until a cell
takes it and it becomes a rank, single-threaded while it waits; the spare factory imports what it
names (rank/factory.py).

The kernel's pool (launch/local/spares.py) starts ``python -m taas_magic.rank --spare`` with
OpenMP and OpenBLAS at one thread, so importing torch (and numpy) starts no thread: a
spare that becomes a rank other than 0 must still be single-threaded when it unshares
its namespaces for the write rule. A spare imports and nothing else: no process group, no
connection, and no CUDA context unless it was started bound to a GPU (``--gpu K``, on a host
with GPUs): then it sets that device, makes its context and takes its first step there, so a
cell on the GPUs pays none of that either. When a cell takes it, the kernel writes the handshake and
then one JSON line with the environment and working directory of *that* launch, which
replace the spare's own before anything of the cell happens.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import sys

# What DDP construction imports, so a warm cell does not pay for it either, then what the
# rank itself imports once it has its cell (the closure loader, the devices). The package never
# imports the face (taas.py): the cell's own ``import taas`` loads it, over modules already here.
# what a cell's rank imports before its first line, imported while the spare waits: the write rule's modules
# too (a rank other than 0 imports them to divert its writes the moment it is taken: 7 ms here, on the
# critical path of a warm cell, whose rank 0 waits in init_process_group for rank 1)
WARM_MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.distributed_c10d",
                "taas_magic.rank.loaders", "taas_magic.rank.devices", "taas_magic.writes.divert",
                "taas_magic.writes.namespace")


first_step_taken = False  # the factory took the first CPU step before forking this spare (factory.py)
for_cell = False  # the factory forked this spare for a cell's rank that already waits for it (factory.py)
namespace_ready = False  # a GPU spare for rank 1 or above entered its namespaces while single-threaded

WAITING_NAME = b"taas-spare"  # the process name (comm) once warm and waiting; tools and tests tell spares by it
TAKEN_NAME = b"taas-rank"


def set_name(name: bytes) -> None:
    import ctypes

    from taas_magic.rank.lifeline import PR_SET_NAME, prctl

    prctl(PR_SET_NAME, ctypes.c_char_p(name))  # not Linux: the name is only a label


def bound_gpu(argv: list[str]) -> int | None:
    """The GPU a spare was started bound to (``--gpu K``), or None for a CPU spare."""
    if "--gpu" in argv:
        index = argv.index("--gpu") + 1
        if index < len(argv) and argv[index].isdigit():
            return int(argv[index])
    return None


def warm_up(gpu: int | None = None) -> None:
    """Import and take a first step (on ``gpu`` when bound to one), then take the name that says "ready".

    A spare bound to GPU 1 or above will be rank 1 or above, which the write rule isolates:
    its CUDA context starts threads, after which ``unshare`` is refused, so it enters its
    namespaces now (writes/namespace.py) and only mounts the overlay once a cell takes it.
    """
    global namespace_ready
    if gpu is not None and gpu > 0:
        from taas_magic.writes.namespace import IsolationUnavailable, enter_namespace

        try:
            enter_namespace()
            namespace_ready = True
        except (IsolationUnavailable, OSError):
            pass  # no namespaces here: the write rule falls back to Python's diversion, and says so
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken or absent torch: the cell will say so itself
            break
    else:
        if gpu is not None:
            _bind(gpu)  # the rank would make this context first thing: never wasted
        if not cell_waiting() and not first_step_taken:
            first_step("cpu")  # only while idle: a cell already waiting would wait for it
    set_name(WAITING_NAME)


def cell_waiting(fd: int = 0) -> bool:
    """Whether a cell took this spare while it was still warming (its handshake waits on stdin,
    or is about to: the factory forked it for a cell's rank)."""
    if for_cell:
        return True
    try:
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError):
        return False


def _bind(gpu: int) -> None:
    """The rank this spare will be uses GPU ``gpu``: set it, make the context, and (while no cell
    waits) take a first step there."""
    import torch

    try:
        torch.cuda.set_device(gpu)
        torch.zeros(1, device=f"cuda:{gpu}")  # the context
        if not cell_waiting():
            first_step(f"cuda:{gpu}")
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the context stays; the step's blocks go back to the GPU
    except Exception:  # noqa: BLE001 - a GPU that cannot be bound now: the rank binds it itself (rank/devices.py)
        pass


def first_step(device: str) -> bool:
    """One tiny training step: the first forward, backward and optimizer steps pay lazy
    imports and first-call set-up (about 0.7 s here on CPU; kernel loading on a GPU) that
    every cell would pay again. It stays on the calling thread (OMP at one thread); on the
    CPU it creates no CUDA context."""
    import torch

    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to(device)
        for optimizer in (torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())):
            inputs = torch.zeros(4, 8, device=device)
            loss = torch.nn.functional.cross_entropy(model(inputs), torch.zeros(4, dtype=torch.long, device=device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception:  # noqa: BLE001 - warming is an optimisation; the cell runs regardless
        return False
    return True


def adopt(settings_line: str) -> None:
    """Become a rank of this launch: its environment and working directory, not the spare's."""
    set_name(TAKEN_NAME)
    settings = json.loads(settings_line)
    os.environ.clear()
    os.environ.update(settings["env"])
    os.chdir(settings["cwd"])


def use_launch_threads() -> None:
    """Give torch the thread count of the launch (the spare imported it with one)."""
    torch = sys.modules.get("torch")
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
