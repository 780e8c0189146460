"""The loaders registered with ``taas.register``: what the data workers prepare for the ranks.

Runs wherever ``import taas`` is: in the kernel, on the cell's thread (a notebook cell's
``taas.register``; the plan step reads the list), and in a rank, whose own list a cell's
``taas.register`` fills.

The list is this process's, kept here and nowhere else: the face (taas.py) passes
``register`` / ``unregister`` / ``registered`` through at each call; the kernel's plan
(kernel/runs/runplan.py) reads it for the loaders a cell's closure reaches, and ``%taas status``
lists it (kernel/magic/linecommands.py). This module imports nothing heavy (the pickler only when a
loader is registered): ``import taas`` imports it.
"""

from __future__ import annotations

from typing import Any

_registered: list[Any] = []  # in registration order, each object once


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
    from taas_magic.transfer import pickler

    try:
        pickler.dumps(loader)
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
