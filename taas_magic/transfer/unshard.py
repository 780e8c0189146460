"""Sharded values made whole again, in place: rank 0, once their DTensors are gathered.

``fully_shard`` (FSDP2) changes a module as it shards it: its class becomes a dynamic
``FSDP<Class>`` (``FSDPModule`` first in its MRO), its parameters become DTensors holding one
rank's shard, and FSDP's state and hooks (forward, state dict, load) are attached to it;
tensor parallelism's ``distribute_module`` attaches hooks of its own. None of that can live
in a notebook with no process group. :func:`make_plain` undoes it on every submodule:

- the class is the original again (the first class in the MRO that is not an ``FSDPModule``),
  so the notebook's ``model`` is a ``Net``;
- each DTensor parameter becomes an ``nn.Parameter`` of the whole tensor gathered for it
  (``requires_grad`` kept, no gradient), each DTensor buffer the whole tensor; a parameter that
  is a view into a larger buffer (FSDP's unsharded parameters, after a forward with no backward)
  becomes a compact copy of itself, so only its own bytes travel;
- every hook that sharding attached (defined in ``torch.distributed.fsdp``, ``.tensor`` or
  ``._composable``) is taken off (the person's own hooks, and ``checkpoint_wrapper``'s, stay), and
  FSDP's composable state and its flags go from the module's ``__dict__``.

:class:`Rebuild` does it for any value a name holds: a module as above, a dict's or a list's
DTensors replaced in place by their whole tensors, a tuple made anew. :func:`tensor_key` says
which tensor a DTensor is (two DTensors over the same view of one local storage, a parameter
and its ``state_dict()`` entry, are one: gathered once, one storage in the notebook).

One object stays one object: ``done`` maps the ids already made plain (modules, parameters,
whole tensors) to what they became, so a tied weight is one ``Parameter`` afterwards and a
module reached from two names is made plain once. Runs in rank 0 only, on the cell's thread,
after the cell and the gather (transfer/sharded.py): in fresh ranks in place (the values are never used in
the rank again); in kept ranks on new objects (:func:`shallow_tree`: new module objects and containers over the
same tensors, no tensor copied), since the next cell goes on with rank 0's sharded model
(:func:`tensor_key` runs in every rank, as the ranks plan the gather).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

# nn.Module's hook tables, by key; private API: see taas_magic/private.py (torch.nn.Module)
HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
               "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")
HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
# what fully_shard leaves in a module's __dict__; private API: see taas_magic/private.py
STATE_KEY = "__composable_api_state_key"
FSDP_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")
SHARDING = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed._composable")  # whose hooks go
ATOMS = (type(None), bool, int, float, complex, str, bytes)  # values with nothing sharded in them


def original_class(cls: type) -> type:
    """The class ``fully_shard`` derived ``cls`` from (``Net`` for ``FSDPNet``); ``cls`` itself otherwise."""
    from torch.distributed.fsdp import FSDPModule

    if not issubclass(cls, FSDPModule):
        return cls
    return next(base for base in cls.__mro__ if not issubclass(base, FSDPModule))


def _sharding_hook(hook: Any) -> bool:
    """Whether ``hook`` is one that sharding attached: a bound method of FSDP's state, a function of
    its parameter groups, tensor parallel's, or nn.Module's wrapper (``.hook``) of one. (Other
    hooks of torch.distributed, such as ``checkpoint_wrapper``'s state dict hooks, stay.)"""
    target = getattr(hook, "__func__", hook)
    target = getattr(target, "hook", target)  # a load_state_dict hook's wrapper; private API: see taas_magic/private.py
    target = getattr(target, "__func__", target)
    return str(getattr(target, "__module__", None) or "").startswith(SHARDING)


def _strip(module: Any) -> None:
    """The original class back, sharding's hooks and FSDP's state off (see the module docstring)."""
    module.__class__ = original_class(type(module))
    state = vars(module)
    for key in [key for key in state if key.startswith(STATE_KEY) or key in FSDP_FLAGS]:
        del state[key]
    for table in HOOK_TABLES:
        hooks = state.get(table)
        if not isinstance(hooks, dict):
            continue
        for key in [key for key, hook in hooks.items() if _sharding_hook(hook)]:
            del hooks[key]
            for flags in HOOK_FLAGS:
                found = state.get(flags)
                if isinstance(found, dict):
                    found.pop(key, None)
                elif isinstance(found, set):
                    found.discard(key)


def oversized(tensor: Any) -> bool:
    """Whether ``tensor``'s storage holds more than its own bytes (a view into a larger buffer, padding)."""
    return not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size()


def make_plain(module: Any, whole: Callable[[Any], Any], done: dict[int, Any]) -> Any:
    """``module`` (and every submodule) made ordinary in place; returns it.

    ``whole(dtensor)`` is the CPU tensor gathered for a DTensor; ``done`` maps ids already made
    plain to what they became, and is filled here.
    """
    import torch
    from torch.distributed.tensor import DTensor

    for sub in module.modules():
        if id(sub) in done:
            continue
        done[id(sub)] = sub
        _strip(sub)
        for name, param in list(sub.named_parameters(recurse=False)):
            if id(param) not in done:
                if isinstance(param, DTensor):
                    done[id(param)] = torch.nn.Parameter(whole(param), requires_grad=param.requires_grad)
                elif oversized(param):
                    done[id(param)] = torch.nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
                else:
                    done[id(param)] = param
            setattr(sub, name, done[id(param)])
        for name, buffer in list(sub.named_buffers(recurse=False)):
            if isinstance(buffer, DTensor):
                done.setdefault(id(buffer), whole(buffer))
                setattr(sub, name, done[id(buffer)])
    return module


def tensor_key(dtensor: Any) -> Any:
    """Which tensor a DTensor is: the same view of the same local storage is the same tensor
    (``model.state_dict()``'s entries are new DTensors over the parameters' shards)."""
    import torch

    with torch.no_grad():
        local = dtensor.to_local()
    pointer = local.untyped_storage().data_ptr()
    if not pointer:  # no memory of its own (meta, empty): only itself
        return id(dtensor)
    return (str(local.device), pointer, local.storage_offset(), tuple(local.shape), tuple(local.stride()),
            tuple(dtensor.shape), str(dtensor.placements))


def shallow_tree(module: Any, clones: dict[int, Any]) -> Any:
    """A new module object for ``module`` and each of its submodules (``clones``: those made so far, by the
    original's id), of the original class, holding the same parameters, buffers and attributes in tables of its
    own: :func:`make_plain` then changes the copy, and ``module`` stays as it is (kept ranks go on using it)."""
    if id(module) in clones:
        return clones[id(module)]
    clone: Any = object.__new__(original_class(type(module)))  # not copy.copy: FSDPModule.__new__ may call __init__
    clones[id(module)] = clone
    state = dict(vars(module))
    for key in ("_parameters", "_buffers", "_modules", *HOOK_TABLES, *HOOK_FLAGS):
        if isinstance(state.get(key), dict):
            state[key] = type(state[key])(state[key])
    vars(clone).update(state)
    for name, child in state["_modules"].items():
        if child is not None:
            state["_modules"][name] = shallow_tree(child, clones)
    return clone


class Rebuild:
    """Rank 0: values with their DTensors replaced by the whole tensors, in place where they can be; or, for ranks
    that are kept (``in_place=False``), in new containers and new module objects, so that rank 0 keeps its own."""

    def __init__(self, whole: dict[Any, Any], in_place: bool = True):
        import torch
        from torch.distributed.tensor import DTensor

        self._whole, self._dtensor, self._torch, self.in_place = whole, DTensor, torch, in_place
        self.done: dict[int, Any] = {}
        self.clones: dict[int, Any] = {}

    def __call__(self, value: Any) -> Any:
        if isinstance(value, ATOMS):
            return value
        if id(value) in self.done:
            return self.done[id(value)]
        torch = self._torch
        if isinstance(value, self._dtensor):
            result = self._whole[tensor_key(value)]
            if isinstance(value, torch.nn.Parameter):
                result = torch.nn.Parameter(result, requires_grad=value.requires_grad)
        elif isinstance(value, torch.nn.Module):
            module = value if self.in_place else shallow_tree(value, self.clones)
            result = make_plain(module, lambda dtensor: self._whole[tensor_key(dtensor)], self.done)
        elif isinstance(value, (dict, list)):
            result = value if self.in_place else copy.copy(value)
            self.done[id(value)] = result  # a cycle meets the value itself
            for key, item in list(value.items() if isinstance(value, dict) else enumerate(value)):
                new = self(item)
                if new is not item:
                    result[key] = new
        elif type(value) is tuple:
            items = [self(item) for item in value]
            result = tuple(items) if any(new is not old for new, old in zip(items, value)) else value
        else:
            result = value
        self.done[id(value)] = result
        return result
