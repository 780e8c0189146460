"""The rank's device: its own GPU before the cell runs, or gloo in place of nccl on CPU.

Runs in each rank, on its main thread, before the cell.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any, Callable


def bind_gpu() -> None:
    """``torch.device("cuda")`` and ``device_ids=[LOCAL_RANK]`` both mean this rank's GPU."""
    import torch

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


def _cpu_backend(backend: object) -> object:
    if isinstance(backend, str) and "nccl" in backend.lower():
        if ":" in backend:  # "cuda:nccl,cpu:gloo" -> "cpu:gloo"
            parts = [part for part in backend.split(",") if "nccl" not in part.lower()]
            return ",".join(parts) or "gloo"
        return "gloo"
    return backend


def serve_nccl_with_gloo(dist: ModuleType) -> None:
    """On a host without GPUs, ``init_process_group(backend='nccl')`` runs with gloo."""
    c10d = dist.distributed_c10d  # private API: see taas_magic/private.py
    for module, name in ((c10d, "init_process_group"), (c10d, "new_group"), (dist, "init_process_group"), (dist, "new_group")):
        original = getattr(module, name, None)
        if original is None or getattr(original, "__taas_cpu__", False):
            continue

        @functools.wraps(original)
        def wrapper(*args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if "backend" in kwargs:
                kwargs["backend"] = _cpu_backend(kwargs["backend"])
            elif args and __original.__name__ == "init_process_group":
                args = (_cpu_backend(args[0]), *args[1:])
            return __original(*args, **kwargs)

        wrapper.__taas_cpu__ = True  # type: ignore[attr-defined]  # a marker on the function: wrapped once only
        setattr(module, name, wrapper)
