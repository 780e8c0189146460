"""Wrappers that travel as what they wrap: a DDP model comes back as its module.

Runs in rank 0, on its main thread, as it packs its names (transfer/pack.py's ``unwrap=True``).

A ``DistributedDataParallel`` pickles in rank 0 while its process group lives, but it
cannot be unpickled in a kernel that has none; ``torch.compile``'s ``OptimizedModule``
drags compiled code along. Neither is what a person wants back: the trained module is.
So the pickler replaces each wrapper, wherever it is reached, by ``same(inner)``, and the
inner module keeps its identity (``ddp_model`` and ``model`` are one object afterwards).

FSDP (``FullyShardedDataParallel``) comes back as its module only when its parameters
are whole in rank 0 (``NO_SHARD``, or a world of one) and are the module's own
(``use_orig_params=True``); otherwise it is refused with a message saying what to bind
instead, since rank 0 alone holds only its shard, or only a flattened parameter.

Classes are recognised by module and name along their MRO, so nothing here imports
torch's distributed or dynamo packages.
"""

from __future__ import annotations

from typing import Any

# (module, class name) -> the attribute holding the wrapped module; private API: see taas_magic/private.py
_WRAPPERS = {
    ("torch.nn.parallel.distributed", "DistributedDataParallel"): "module",
    ("torch.nn.parallel.data_parallel", "DataParallel"): "module",
    ("torch._dynamo.eval_frame", "OptimizedModule"): "_orig_mod",
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"): "module",
}
_FSDP = "FullyShardedDataParallel"
_by_class: dict[type, tuple[str, str] | None] = {}


def same(obj: Any) -> Any:
    """What a wrapper is pickled as: its inner module, by identity."""
    return obj


def _wrapper_of(cls: type) -> tuple[str, str] | None:
    """(wrapper class name, attribute) when ``cls`` is one of the wrappers, else None."""
    try:
        return _by_class[cls]
    except KeyError:
        pass
    found = None
    for base in cls.__mro__:
        attribute = _WRAPPERS.get((base.__module__, base.__name__))
        if attribute is not None:
            found = (base.__name__, attribute)
            break
    _by_class[cls] = found
    return found


def _refuse_sharded(wrapper: Any) -> None:
    strategy = getattr(wrapper, "sharding_strategy", None)
    world = getattr(wrapper, "world_size", 1)
    if world > 1 and getattr(strategy, "name", "") != "NO_SHARD":
        raise TypeError(
            "FullyShardedDataParallel holds only this rank's shard of each parameter; gather a full "
            "state dict in the cell (FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT)) and bind that"
        )
    if not getattr(wrapper, "_use_orig_params", False):
        raise TypeError(
            "FullyShardedDataParallel(use_orig_params=False) keeps the module's parameters flattened into one; "
            "wrap with use_orig_params=True, or bind model.state_dict()"
        )


def unwrap(obj: Any) -> tuple[Any, str] | None:
    """(the innermost module, the outermost wrapper's class name), or None if not a wrapper.

    Raises:
        TypeError: a sharded FSDP module, which rank 0 alone cannot give back whole.
    """
    found = _wrapper_of(type(obj))
    if found is None:
        return None
    outer = found[0]
    while found is not None:
        if found[0] == _FSDP:
            _refuse_sharded(obj)
        obj = getattr(obj, found[1])
        found = _wrapper_of(type(obj))
    return obj, outer
