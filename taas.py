"""``import taas``: the notebook-side API of taas_magic.

An API-compatible, open replacement for the hosted platform's client of the same
name (the two packages both provide a top-level ``taas`` module and cannot be
installed side by side). This module imports nothing heavy: torch is imported only
by :func:`get_worker_info`, inside a rank, where it is already loaded.

- :func:`register` / :func:`unregister` / :func:`registered`: the DataLoaders that
  taas data workers prepare for the ranks (``--cpus``/``--units``).
- :func:`get_worker_info`: inside a rank, torch's ``WorkerInfo`` with
  ``id=RANK`` and ``num_workers=WORLD_SIZE``; outside a rank, ``None``.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["register", "unregister", "registered", "get_worker_info", "in_rank"]

_registered: list[Any] = []

# Set by the rank bootstrap (taas_magic.rank) in the rank processes it starts; a
# subprocess the cell starts inherits the environment but is not a rank.
_IN_RANK = False


def in_rank() -> bool:
    """True inside a process that taas started to run a cell as one rank."""
    return _IN_RANK


def register(loader: Any) -> Any:
    """Register a DataLoader (or any re-iterable, picklable object) for data workers.

    Returns the loader, so ``train_loader = taas.register(DataLoader(...))`` works.

    Raises:
        TypeError: the object cannot be iterated or cannot be pickled.
    """
    if not hasattr(loader, "__iter__"):
        raise TypeError(
            f"taas.register: {type(loader).__name__} object is not iterable; "
            "register a DataLoader or another object that can be iterated more than once"
        )
    if hasattr(loader, "__next__"):
        raise TypeError(
            f"taas.register: {type(loader).__name__} is an iterator, which can be consumed only once; "
            "register the re-iterable object that produces it (e.g. the DataLoader)"
        )
    import cloudpickle

    try:
        cloudpickle.dumps(loader)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the person's to fix
        raise TypeError(
            f"taas.register: {type(loader).__name__} cannot be pickled ({type(exc).__name__}: {exc}); "
            "data workers run in other processes and must receive the loader"
        ) from None
    if not any(item is loader for item in _registered):
        _registered.append(loader)
    return loader


def unregister(loader: Any) -> None:
    """Return a registered loader to normal; unknown loaders are ignored."""
    _registered[:] = [item for item in _registered if item is not loader]


def registered() -> list[Any]:
    """The registered loaders, in registration order."""
    return list(_registered)


def get_worker_info() -> Any:
    """Inside a rank, torch's ``WorkerInfo(id=RANK, num_workers=WORLD_SIZE)``; else ``None``."""
    if not _IN_RANK:
        return None
    from torch.utils.data._utils.worker import WorkerInfo

    rank = int(os.environ["RANK"])
    return WorkerInfo(
        id=rank,
        num_workers=int(os.environ["WORLD_SIZE"]),
        seed=int(os.environ.get("TAAS_SEED", "0")) + rank,
        dataset=None,  # type: ignore[arg-type]  # a rank has no dataset of its own
    )
