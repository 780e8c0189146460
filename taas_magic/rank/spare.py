"""A spare rank: Python and torch imported ahead of time, waiting for a cell to take it.

The kernel's pool (launch/spares.py) starts ``python -m taas_magic.rank --spare`` with
OpenMP and OpenBLAS at one thread, so importing torch (and numpy) starts no thread: a
spare that becomes a rank other than 0 must still be single-threaded when it unshares
its namespaces for the write rule. A spare imports and nothing else: no CUDA context, no
process group, no connection. When a cell takes it, the kernel writes the handshake and
then one JSON line with the environment and working directory of *that* launch, which
replace the spare's own before anything of the cell happens.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

# What DDP construction imports, so a warm cell does not pay for it either.
WARM_MODULES = ("torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.distributed_c10d")


PR_SET_NAME = 15
WAITING_NAME = b"taas-spare"  # the process name (comm) while waiting; tools and tests tell spares by it
TAKEN_NAME = b"taas-rank"


def _set_name(name: bytes) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the name is only a label


def warm_up() -> None:
    _set_name(WAITING_NAME)
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken or absent torch: the cell will say so itself
            return


def adopt(settings_line: str) -> None:
    """Become a rank of this launch: its environment and working directory, not the spare's."""
    _set_name(TAKEN_NAME)
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
