"""A sharded value too big to come back whole: a handle to the DCP checkpoint its ranks wrote.

When a name rank 0 binds holds more DTensor bytes than the notebook's host can take
(transfer/sharded.py decides), every rank saves it together with
``torch.distributed.checkpoint.save`` (:func:`save`: a module's ``state_dict()``, a state dict
itself, anything else under the key ``"value"``) into a folder of the run's checkpoint folder,
each rank writing only its own shards. Rank 0 binds the name to a :class:`CheckpointHandle`
instead: small (the folder, and the shape and dtype of each tensor), pickled like any value.

In the notebook, :meth:`CheckpointHandle.load` reads the checkpoint with no process group
(``dcp.load(..., no_dist=True)``): into fresh CPU tensors (the whole state dict, once), or,
with ``into=module``, straight into that module's own tensors (nothing else allocated). Both
are public torch APIs. The folder stays with the run's checkpoints (remove it yourself).

Runs in every rank, on the cell's thread (:func:`save`; :func:`template` in rank 0 only), and in
the kernel, on whatever thread the notebook calls the handle from.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

WRAPPED = "value"  # the key a value that is not a dict is saved under


@dataclass(frozen=True)
class TensorShape:
    """Where a tensor was: what :meth:`CheckpointHandle.load` allocates for it."""

    shape: tuple[int, ...]
    dtype: str  # "float32": an attribute of torch


def state_of(value: Any) -> tuple[dict[str, Any], bool]:
    """What DCP saves for ``value``, and whether it is wrapped under :data:`WRAPPED`."""
    import torch

    if isinstance(value, torch.nn.Module):
        return value.state_dict(), False
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return value, False
    return {WRAPPED: value}, True


def save(value: Any, path: str) -> tuple[dict[str, Any], bool]:
    """Every rank, together: ``value`` saved as a DCP checkpoint in ``path``; what was saved (see :func:`state_of`)."""
    import torch.distributed.checkpoint as dcp

    state, wrapped = state_of(value)
    dcp.save(state, checkpoint_id=path)
    return state, wrapped


def template(state: Any) -> Any:
    """``state`` with each tensor (a DTensor: its whole shape) replaced by its :class:`TensorShape`."""
    import torch

    if isinstance(state, torch.Tensor):
        return TensorShape(tuple(state.shape), str(state.dtype).removeprefix("torch."))
    if isinstance(state, dict):
        return {key: template(item) for key, item in state.items()}
    if _sequence(state):
        return _remade(state, [template(item) for item in state])
    return state  # DCP saves it pickled, and loads it back in its place


def _sequence(value: Any) -> bool:
    """A list, a tuple, or a named tuple: what the template looks into (a named tuple's tensors are not kept in it)."""
    return type(value) in (list, tuple) or (isinstance(value, tuple) and hasattr(type(value), "_fields"))


def _remade(value: Any, items: list[Any]) -> Any:
    """``value``'s kind of sequence holding ``items`` (a named tuple takes them as its fields)."""
    return type(value)(*items) if hasattr(type(value), "_fields") else type(value)(items)


def _empty(shape: Any) -> Any:
    import torch

    if isinstance(shape, TensorShape):
        return torch.empty(shape.shape, dtype=getattr(torch, shape.dtype))
    if isinstance(shape, dict):
        return {key: _empty(item) for key, item in shape.items()}
    if _sequence(shape):
        return _remade(shape, [_empty(item) for item in shape])
    return shape


def _count(shape: Any) -> int:
    if isinstance(shape, TensorShape):
        return 1
    items = shape.values() if isinstance(shape, dict) else shape if _sequence(shape) else ()
    return sum(_count(item) for item in items)


def _read(state: dict[str, Any], path: str) -> None:
    """``state``'s tensors filled in place from the checkpoint at ``path``, in this process alone."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # that it loads in one process, with no group, is what we ask for
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(state, checkpoint_id=path, no_dist=True)


class CheckpointHandle:
    """A name that was too big to come back whole: its DCP checkpoint, and how to load it.

    ``name``: the notebook's name; ``what``: its class in the rank (``Net``, ``dict``);
    ``nbytes``: its tensors' bytes, whole; ``path``: the checkpoint's folder.
    """

    def __init__(self, name: str, what: str, nbytes: int, path: str, shape: Any, wrapped: bool):
        self.name, self.what, self.nbytes, self.path = name, what, nbytes, path
        self._shape, self._wrapped = shape, wrapped

    def load(self, into: Any = None) -> Any:
        """The whole value, read from the checkpoint on CPU with no process group.

        Without ``into``: its state dict (a module's), or the value itself (a state dict, a
        tensor), in fresh tensors. With ``into`` (a module with the same state dict keys, or a
        state dict): loaded into its own tensors in place; returns ``into``.
        """
        import torch

        if into is not None:
            state = into.state_dict() if isinstance(into, torch.nn.Module) else into
            _read({WRAPPED: state} if self._wrapped else state, self.path)
            return into
        state = _empty(self._shape)
        _read(state, self.path)
        return state[WRAPPED] if self._wrapped else state

    def __repr__(self) -> str:
        from taas_magic.transfer.cudaipc import size_text

        count = _count(self._shape)
        return (f"<taas CheckpointHandle {self.name} ({self.what}, {count} tensor{'s' if count != 1 else ''}, "
                f"{size_text(self.nbytes)} whole) at {self.path!r}: .load() reads it whole, "
                f".load(into=...) into your own module or state dict>")
