"""``%taas heal --from K``: a kept rank's names copied into the ranks that lack them (a rank that replaced a dead one).

Runs in every kept rank, in the cell the kernel sends for the command (kernel/magic/linecommands.py), over the ranks'
default process group. Every rank says which names it holds; rank ``K`` sends each rank the names of its own that
rank lacks (or the names given, even where it has them), pickled together so that what they share stays shared (a
model and the optimizer over its parameters); the other ranks wait. What must not be copied is left where it is, and
rank 0 prints one line per rank saying what it got and what it did not, and why:

- a sharded value (a DTensor, an FSDP2 module, an optimizer over DTensors): rank ``K``'s shard is not this rank's;
- a rank-specific value: a ``DistributedSampler``, or a ``DataLoader`` over one (its rank is ``K``'s);
- a process group or a ``DeviceMesh``: every rank makes one together;
- a value that does not pickle (a generator, an open file, a lambda);
- a module is imported again by its name; the cells' own functions and classes go by value (cloudpickle).

A model wrapped in DDP is copied with its parameters and made a DDP of the default group again there (DDP's own
unpickling); then every rank's DDP models rebuild their reducer, so that all ranks bucket their gradients alike from
the next step (a reducer that has already reordered its buckets would disagree with the new one's), with the
communication hook the model had (DDP's unpickling leaves it out).

At its peak a copied value exists three times on rank ``K`` (the object, its pickle, the tensor it is sent as) and
twice on a receiving rank (the tensor received, then the object): heal copies what a replaced rank lacks, not a
model larger than a third of a host's memory.
"""

from __future__ import annotations

import functools
import importlib
import pickle
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Sequence

import cloudpickle

from taas_magic.rank import shell


@dataclass(frozen=True)
class Imported:
    """A module, sent as its name: imported again on the receiving rank."""

    name: str


def heal(source: int, names: Sequence[str] = ()) -> None:
    """Rank ``source``'s names (``names``, or every one a rank lacks) copied into the other ranks (module docstring)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        print("taas: heal: the kept ranks have no default process group, which heal copies over: make it "
              "(init_process_group) in a kept cell first")
        return
    namespace = sys.modules["__main__"].__dict__
    rank, world = dist.get_rank(), dist.get_world_size()
    held: list[Any] = [None] * world
    dist.all_gather_object(held, shell.user_names(namespace))
    said: list[str] = []
    packed: dict[tuple[str, ...], tuple[bytes, dict[str, str]]] = {}  # pickled once for the ranks that lack the same
    for target in range(world):
        wanted = list(names) if names else [name for name in held[source] if name not in held[target]]
        if target == source or not wanted:
            continue
        if rank == source:
            if tuple(wanted) not in packed:
                packed[tuple(wanted)] = _pack(namespace, wanted, source)
            data, refused = packed[tuple(wanted)]
            dist.send_object_list([data, refused], dst=target)
        elif rank == target:
            box: list[Any] = [None, None]
            dist.recv_object_list(box, src=source)
            copied = _unpack(namespace, box[0])
            said.append(_line(target, source, copied, box[1]))
    packed.clear()
    rebuilt = _rebuild_ddp(namespace)  # on every rank alike
    if rank == 0:
        said += rebuilt
    lines: list[Any] = [None] * world
    dist.all_gather_object(lines, said)
    if rank == 0:
        for line in [line for each in lines for line in each] or [f"taas: heal: every rank holds rank {source}'s names"]:
            print(line)


def _pack(namespace: dict, wanted: Sequence[str], source: int) -> tuple[bytes, dict[str, str]]:
    """The names that may go, pickled together (a pickle each where together fails), and why the others may not."""
    refused: dict[str, str] = {}
    going: dict[str, Any] = {}
    for name in wanted:
        if name not in namespace:
            refused[name] = f"rank {source} has no {name}"
            continue
        value = namespace[name]
        why = _why_not(value, source)
        if why is not None:
            refused[name] = why
        else:
            going[name] = Imported(value.__name__) if isinstance(value, ModuleType) else value
    try:  # the cells' own functions and classes by value (their __main__ is not the receiver's)
        return cloudpickle.dumps(going, protocol=pickle.HIGHEST_PROTOCOL), refused
    except Exception:  # noqa: BLE001 - one of them does not pickle: find which, send the rest
        pass
    alone: dict[str, bytes] = {}
    for name, value in going.items():
        try:
            alone[name] = cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:  # noqa: BLE001 - said in the line, the name named
            refused[name] = f"it does not pickle ({type(error).__name__}: {error})"
    return pickle.dumps({name: _Pickled(data) for name, data in alone.items()}), refused


@dataclass(frozen=True)
class _Pickled:
    data: bytes


def _unpack(namespace: dict, data: bytes) -> list[str]:
    """The names bound here, in the order they came."""
    received = pickle.loads(data)  # noqa: S301 - from a kept rank of this run, over its process group
    for name, value in received.items():
        if isinstance(value, _Pickled):
            value = pickle.loads(value.data)  # noqa: S301 - as above
        namespace[name] = importlib.import_module(value.name) if isinstance(value, Imported) else value
    return list(received)


def _why_not(value: Any, source: int) -> str | None:
    """Why a value must not be copied from rank ``source`` to another rank, or None."""
    if _sharded(value):
        return f"it is sharded: rank {source}'s shard is not this rank's (make it again on every rank)"
    sampler = getattr(value, "sampler", value)
    if type(sampler).__name__ == "DistributedSampler":
        return f"its DistributedSampler is rank {source}'s (make it again on this rank)"
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and isinstance(value, distributed.ProcessGroup):
        return "a process group is made by every rank together (make it again on every rank)"
    if type(value).__name__ == "DeviceMesh":
        return "a DeviceMesh is made by every rank together (make it again on every rank)"
    return None


def _sharded(value: Any) -> bool:
    tensors = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(tensors, "DTensor", None)
    if dtensor is None:
        return False
    if isinstance(value, dtensor):
        return True
    parameters = getattr(value, "parameters", None)
    if callable(parameters):
        try:
            return any(isinstance(parameter, dtensor) for parameter in parameters())
        except TypeError:
            return False
    groups = getattr(value, "param_groups", None)  # an optimizer
    return isinstance(groups, list) and any(isinstance(parameter, dtensor) for group in groups
                                            for parameter in group.get("params", ()))


def _rebuild_ddp(namespace: dict) -> list[str]:
    """Every DDP model bound to a name here: its reducer made again (DDP's own pickling pair), on every rank alike;
    the line that says so (and one for a model that could not be)."""
    parallel = sys.modules.get("torch.nn.parallel")
    ddp = getattr(parallel, "DistributedDataParallel", None)
    if ddp is None:
        return []
    rebuilt, lines = [], []
    for name, value in sorted(namespace.items()):
        if isinstance(value, ddp) and not name.startswith("_"):
            builtin = _builtin_hook(value)
            try:
                value.__setstate__(value.__getstate__())
            except Exception as error:  # noqa: BLE001 - alike on every rank (a group not the default): said
                lines.append(f"taas: heal: {name}'s DDP reducer kept as it was ({type(error).__name__}: {error})")
                continue
            rebuilt.append(name)
            try:
                _hooks_again(value, builtin)
            except Exception as error:  # noqa: BLE001 - the hook refused its new reducer: said
                lines.append(f"taas: heal: {name}'s DDP reducer rebuilt without its communication hook "
                             f"({type(error).__name__}: {error})")
    return ([f"taas: heal: DDP's reducer rebuilt on every rank for {', '.join(rebuilt)}"] if rebuilt else []) + lines


def _hooks_again(model: Any, builtin: Any) -> None:
    """The model's communication hook registered on its new reducer, which DDP's unpickling makes without one while
    the model still lists it (``_comm_hooks``; private, see taas_magic/private.py): a PowerSGD or fp16 hook would
    silently stop compressing (DDP takes one hook a model). A ``builtin`` one (not in the list) is registered again
    instead. PowerSGD starts again from its plain all-reduce: its error feedback and low-rank memories are sized by
    the old reducer's buckets, which the new one makes anew (and on a rank that got the model from another, they are
    that rank's)."""
    hooks, model._comm_hooks = list(model._comm_hooks), []
    for hook, state in hooks:
        _restart_powersgd(state)
        model.register_comm_hook(state, hook)
    if not hooks and builtin is not None:
        model._register_builtin_comm_hook(builtin)


def note_builtin_hooks(module: ModuleType) -> None:
    """Each DDP model made from now on notes the built-in communication hook registered on it by its name
    (``_register_builtin_comm_hook``, such as fp16 compression; DDP's list of hooks leaves built-ins out, and only the
    model's logger, which stays behind when heal copies the model, names it): the note travels with the model, and
    heal registers the hook again on every rank's new reducer (kept ranks: rank/main.py)."""
    ddp = module.DistributedDataParallel
    builtin = ddp._register_builtin_comm_hook

    @functools.wraps(builtin)
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        builtin(self, comm_hook_type)
        self._taas_builtin_hook = comm_hook_type.name

    ddp._register_builtin_comm_hook = _register_builtin_comm_hook


def _builtin_hook(model: Any) -> Any:
    """The built-in hook noted on the model (:func:`note_builtin_hooks`), or None."""
    kinds = getattr(sys.modules.get("torch.distributed"), "BuiltinCommHookType", None)
    name = getattr(model, "_taas_builtin_hook", None)
    return kinds.__members__.get(name) if kinds is not None and name else None


def _restart_powersgd(state: Any) -> None:
    """A PowerSGD hook's state as at its start (its public fields): plain all-reduce until ``start_powerSGD_iter``."""
    powersgd = sys.modules.get("torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook")
    if powersgd is not None and isinstance(state, powersgd.PowerSGDState):
        state.error_dict.clear()
        state.p_memory_dict.clear()
        state.q_memory_dict.clear()
        state.iter = 0


def _line(target: int, source: int, copied: list[str], refused: dict[str, str]) -> str:
    got = f"copied {', '.join(copied)} from rank {source}" if copied else f"copied nothing from rank {source}"
    kept_back = "; ".join(f"not {name}: {why}" for name, why in refused.items())
    return f"taas: heal: rank {target}: {got}" + (f"; {kept_back}" if kept_back else "")
