"""Sharded values come back whole: the ranks gather together what rank 0 sends (FSDP2, DTensor).

Runs in every rank, on its main thread after the cell (:func:`bring_whole`), and in the kernel's
plan step (:func:`gather_limit`).

A name rank 0 binds to an FSDP2 (``fully_shard``) or DTensor-sharded module, or to a state
dict of DTensors, holds only rank 0's shards: alone, rank 0 cannot send it. So after the cell,
before rank 0 sends its names (transfer/returns.py), every rank runs :func:`bring_whole`, on the
cell's thread:

1. **Which names.** The names its cell bound or changed, the shipped names still bound to what
   they received, and the final value (last), in sorted order. Each is walked (:class:`_Walk`):
   a module's parameters and buffers, submodule by submodule; a dict's values; a list's or
   tuple's items. A name is *sharded* when the walk meets a DTensor or an ``FSDPModule``. Its
   plan lists each DTensor met (whole shape, dtype, placements); an object an earlier name (or
   this one) already met is an alias of that name, gathered once. Two DTensors over the same
   view of one local storage (a parameter, and its entry in ``model.state_dict()``) are one
   tensor: gathered once, and one storage in the notebook, as a state dict shares its model's.
2. **Agreement.** The ranks exchange their plans (``all_gather_object`` on the default group)
   and gather only the names whose plan is the same on every rank (and whose aliases are of such
   names). Rank 0 lists the others, so ranks that disagree never wait on each other.
3. **Whole, or a handle.** In that order, a name comes back whole while the total stays within
   ``spec.gather_bytes`` (the kernel's :func:`gather_limit`); past it, every rank saves the name
   with DCP into the run's checkpoint folder and rank 0 binds a handle to it
   (transfer/dcphandle.py). Both decisions depend only on agreed plans: every rank takes them alike.
4. **Gather.** One DTensor at a time, in plan order, every rank calls ``full_tensor()`` (under
   ``no_grad``); rank 0 keeps a compact CPU copy, the others drop theirs at once. Rank 0 then
   holds the whole values once, plus one tensor in flight.
5. **Rank 0 rebuilds** each value in place: a module made ordinary (transfer/unshard.py), a
   dict's or list's DTensors replaced by their whole tensors; one object stays one object.

The gather needs the default group, which cells end with ``destroy_process_group()``: in a
cell that imported ``torch.distributed.tensor`` that destroy waits until this is done
(rank/groups.py). A cell that never imported DTensor costs nothing here: no walk, no collective.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import time
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

from taas_magic.runspec import RunSpec
from taas_magic.transfer import dcphandle, unshard
from taas_magic.transfer.cudaipc import size_text
from taas_magic.transfer.pack import type_name
from taas_magic.transfer.returns import CellResults
from taas_magic.transfer.unpack import FINAL

DTENSOR = "torch.distributed.tensor"
LIMIT_VARIABLE = "TAAS_GATHER_MAX_BYTES"
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def gather_limit(meminfo: str = "/proc/meminfo") -> tuple[int, str]:
    """Kernel, at plan: the most bytes sharded names may bring whole to this host, and why (0: no limit).

    At the peak the host holds a gathered value twice (rank 0's copy and the memory file the kernel
    maps), so half of ``MemAvailable`` now; ``TAAS_GATHER_MAX_BYTES`` lowers it.
    """
    limit, why = 0, ""
    available = _available(meminfo)
    if available is not None:
        limit, why = available // 2, f"half of this host's {size_text(available)} free at launch"
    lowered = os.environ.get(LIMIT_VARIABLE, "").strip()
    if lowered.isdigit() and (not limit or int(lowered) < limit):
        limit, why = int(lowered), f"{LIMIT_VARIABLE}={lowered}"
    return limit, why


MEMINFO_SECONDS = 1.0  # cells planned this soon after one another (kept cells) share one reading of /proc/meminfo
_read_at: dict[str, tuple[float, int | None]] = {}


def _available(meminfo: str) -> int | None:
    """``MemAvailable`` in bytes (None: not known), read at most once in :data:`MEMINFO_SECONDS`: the kernel
    makes the file anew at each read, a tenth of a kept cell's plan."""
    now = time.monotonic()
    read = _read_at.get(meminfo)
    if read is not None and now - read[0] < MEMINFO_SECONDS:
        return read[1]
    available = None
    try:
        with open(meminfo) as lines:
            available = next(int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    _read_at[meminfo] = (now, available)
    return available


# -- 1. which names, and each one's plan -----------------------------------------------------------
@dataclass
class _Plan:
    entries: list[tuple] = field(default_factory=list)  # what every rank must agree on
    gathers: list[Any] = field(default_factory=list)  # this rank's DTensors to gather, in order
    nbytes: int = 0  # the whole bytes of those
    shared: int = 0  # the whole bytes of what it shares with names before it (its aliases)
    modules: bool = False  # an FSDPModule is in it

    def aliases(self) -> set[str]:
        return {entry[1] for entry in self.entries if entry[0] in ("alias", "same")}


class _Walk:
    """Each name's plan, names in order; an object a sharded name met before is an alias of it."""

    def __init__(self) -> None:
        import torch
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        self._module, self._fsdp, self._dtensor = torch.nn.Module, FSDPModule, DTensor
        self.first: dict[Any, str] = {}  # a sharded object's id (a DTensor's tensor_key) -> the first name to meet it
        self._bytes: dict[Any, int] = {}  # the same key -> its DTensors' whole bytes
        self._keep: list[Any] = []  # what those ids name stays alive while we walk

    def plan(self, name: str, value: Any) -> _Plan | None:
        """``value``'s plan, or None when nothing in it is sharded."""
        plan = _Plan()
        if not isinstance(value, self._dtensor) and id(value) in self.first:
            plan.entries.append(("same", self.first[id(value)]))
            plan.shared = self._bytes[id(value)]
        else:
            self._visit(name, value, plan, set())
        return plan if plan.entries else None

    def _visit(self, name: str, value: Any, plan: _Plan, visiting: set[int]) -> None:
        if isinstance(value, unshard.ATOMS) or id(value) in visiting:
            return
        key = unshard.tensor_key(value) if isinstance(value, self._dtensor) else id(value)
        if key in self.first:
            plan.entries.append(("alias", self.first[key]))
            plan.shared += self._bytes[key]
            return
        before, bytes_before = len(plan.entries), plan.nbytes + plan.shared
        if isinstance(value, self._dtensor):
            plan.entries.append(("dt", tuple(value.shape), str(value.dtype), str(value.placements)))
            plan.gathers.append(value)
            plan.nbytes += value.numel() * value.dtype.itemsize
        elif isinstance(value, self._module):
            self._visit_module(name, value, plan)
        elif isinstance(value, (dict, list, tuple)):
            visiting.add(id(value))
            for item in (value.values() if isinstance(value, dict) else value):
                self._visit(name, item, plan, visiting)
        if len(plan.entries) > before:
            self.first.setdefault(key, name)
            self._bytes[key] = plan.nbytes + plan.shared - bytes_before
            self._keep.append(value)

    def _visit_module(self, name: str, module: Any, plan: _Plan) -> None:
        for sub in module.modules():
            if isinstance(sub, self._fsdp):
                plan.modules = True
                plan.entries.append(("fsdp", unshard.original_class(type(sub)).__qualname__))
            for tensor in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]:
                if isinstance(tensor, self._dtensor):
                    self._visit(name, tensor, plan, set())


def _order(names: Any) -> list[str]:
    return sorted(name for name in names if name != FINAL) + ([FINAL] if FINAL in names else [])


def _candidates(results: CellResults, closure: dict[str, Any]) -> dict[str, Any]:
    """What rank 0 may send, by name in order: the names the cell bound, the shipped names still bound
    to what they received (changed in place, perhaps: ``fully_shard(model)`` on a notebook model),
    and the final value."""
    namespace = results.namespace
    values = {name: namespace[name] for name in results.changed}
    values.update((name, value) for name, value in closure.items() if name in namespace and namespace[name] is value)
    if results.has_final:
        values[FINAL] = results.final
    return {name: values[name] for name in _order(values)}


# -- 2. and 3. agreement, then whole or a handle ---------------------------------------------------
def _agree(dist: ModuleType, plans: dict[str, _Plan]) -> list[str]:
    """The names whose plan every rank has alike, in order (a collective of every rank)."""
    mine = {name: plan.entries for name, plan in plans.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    agreed: list[str] = []
    for name in _order(everyone[0]):
        entries = everyone[0][name]
        targets = {entry[1] for entry in entries if entry[0] in ("alias", "same")} - {name}
        if all(each.get(name) == entries for each in everyone) and targets <= set(agreed):
            agreed.append(name)
    return agreed


@dataclass
class _Decision:
    whole: list[str] = field(default_factory=list)
    handles: dict[str, str] = field(default_factory=dict)  # name -> its checkpoint folder
    room: dict[str, int] = field(default_factory=dict)  # a handle too big -> the bytes the gather had left for it
    failed: dict[str, str] = field(default_factory=dict)  # name -> why it cannot come back


def _decide(agreed: list[str], plans: dict[str, _Plan], limit: int, folder: str | None) -> _Decision:
    decision, total = _Decision(), 0
    for name in agreed:
        plan = plans[name]
        same = [entry[1] for entry in plan.entries if entry[0] == "same"]
        if same and same[0] in decision.handles:
            decision.handles[name] = decision.handles[same[0]]
        elif plan.aliases() & set(decision.failed):
            decision.failed[name] = f"shares DTensors with {', '.join(sorted(plan.aliases() & set(decision.failed)))}"
        elif not plan.aliases() & set(decision.handles) and (not limit or total + plan.nbytes <= limit):
            decision.whole.append(name)
            total += plan.nbytes
        elif folder is None:
            decision.failed[name] = (f"{size_text(plan.nbytes + plan.shared)} whole, too big to come back, and the run "
                                     "has no checkpoint folder")
        else:  # too big, or sharing DTensors with a name that is: its own checkpoint
            decision.handles[name] = os.path.join(folder, "whole-" + re.sub(r"[^\w.-]", "_", name.strip("<>")))
            if not plan.aliases() & set(decision.handles):
                decision.room[name] = limit - total
    return decision


# -- 4. and 5. gather, rebuild ---------------------------------------------------------------------
def _freed_at_once() -> None:
    """From now on glibc maps every block of 1 MB or more on its own, and unmaps it when freed.

    Otherwise, once a block of a few MB is freed, glibc raises its mmap threshold and serves the
    next ones from its heap, where freed memory stays: gathering a 96 MB model of 4 MB parameters,
    the rank that keeps nothing grew by 43 MB; with this, by one parameter (tests/kernel/test_sharded_results.py).
    The rank only sends its results after this. A no-op where the C library is not glibc."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def _gather(names: list[str], plans: dict[str, _Plan], keep: bool) -> dict[Any, Any]:
    """Every rank: each DTensor of ``names``, whole; rank 0 (``keep``) keeps a compact CPU copy of each,
    by its ``unshard.tensor_key``."""
    import torch

    whole: dict[Any, Any] = {}
    if any(plans[name].gathers for name in names):
        _freed_at_once()
    for name in names:
        for dtensor in plans[name].gathers:
            with torch.no_grad():
                full = dtensor.full_tensor()
            if keep:
                full = full.detach().cpu()
                whole[unshard.tensor_key(dtensor)] = full.clone() if unshard.oversized(full) else full
            del full
    return whole


def _whole_note(plan: _Plan, before: str, after: Any, world: int) -> str:
    became = f" as {type(after).__name__}" if type(after).__name__ != before.rsplit(".", 1)[-1] else ""
    if not plan.gathers:
        return f"came back whole{became} (gathered with {', '.join(sorted(plan.aliases()))})"
    count = len(plan.gathers)
    return (f"came back whole{became} ({count} DTensor{'s' if count != 1 else ''} gathered from {world} ranks, "
            f"{size_text(plan.nbytes)})")


def _handle_note(name: str, plan: _Plan, handle: Any, room: int | None, spec: RunSpec) -> str:
    kind = "FSDP" if plan.modules else "DTensor"
    same = [entry[1] for entry in plan.entries if entry[0] == "same"]
    if same:
        why = f"the very object {same[0]} is"
    elif room is None:
        why = "sharing DTensors with a name that did not come back whole"
    else:
        limit = size_text(spec.gather_bytes)
        left = f"the {size_text(room)} left of the {limit}" if room < spec.gather_bytes else f"the {limit}"
        why = f"more than {left} a gather may bring to this host ({spec.gather_why})"
    return (f"{kind}-sharded, {size_text(plan.nbytes + plan.shared)} whole, {why}; bound as a handle to its DCP "
            f"checkpoint at {handle.path}: {'Out[]' if name == FINAL else name}.load() reads it whole")


# -- the whole step --------------------------------------------------------------------------------
def bring_whole(results: CellResults, closure: dict[str, Any], spec: RunSpec, rank: int,
                ) -> tuple[CellResults, dict[str, Any]]:
    """Every rank, after its cell and before the deferred destroy (see the module docstring).

    ``results``: what the cell bound (transfer/returns.py's, computed alike in every rank);
    ``closure``: the shipped values as loaded. Returns them as rank 0 sends them: each sharded name
    whole, a handle, or listed in ``results.failed`` with why (other ranks: unchanged).
    """
    dist = sys.modules.get("torch.distributed")
    if DTENSOR not in sys.modules or dist is None or not dist.is_initialized():
        return results, closure
    return _bring_whole(dist, results, closure, spec, rank)


@dataclass
class _Outcome:
    """Rank 0: what each sharded name becomes."""

    bound: dict[str, Any] = field(default_factory=dict)  # name -> the value it sends
    notes: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (its type in the rank, a note)
    failed: dict[str, str] = field(default_factory=dict)  # name -> why it does not come back


def _bring_whole(dist: ModuleType, results: CellResults, closure: dict[str, Any], spec: RunSpec, rank: int,
                 ) -> tuple[CellResults, dict[str, Any]]:
    values = _candidates(results, closure)
    walk = _Walk()
    plans = {name: plan for name, value in values.items() if (plan := walk.plan(name, value)) is not None}
    outcome = _Outcome()
    try:  # collectives: every rank calls each one alike, whatever it holds
        agreed = _agree(dist, plans)
        decision = _decide(agreed, plans, spec.gather_bytes, spec.checkpoints or None)
        saved: dict[str, Any] = {}
        for name, path in decision.handles.items():
            if path not in saved:
                state, wrapped = dcphandle.save(values[name], path)
                what = unshard.original_class(type(values[name])).__name__
                saved[path] = dcphandle.CheckpointHandle(name, what, plans[name].nbytes + plans[name].shared, path,
                                                         dcphandle.template(state) if rank == 0 else None, wrapped)
            outcome.bound[name] = saved[path]
            note = _handle_note(name, plans[name], saved[path], decision.room.get(name), spec)
            outcome.notes[name] = (type_name(values[name]), note)
        whole = _gather(decision.whole, plans, keep=rank == 0)
    except Exception as exc:  # noqa: BLE001 - the cell succeeded: its other names still come back
        why = f"could not be gathered: {type(exc).__name__}: {exc}".splitlines()[0]
        return _apply(results, closure, _Outcome(failed={name: why for name in plans})) if rank == 0 else (results, closure)
    if rank != 0:
        return results, closure
    rebuild = unshard.Rebuild(whole, in_place=not spec.keep)  # kept ranks keep their own sharded values
    before = {name: type_name(values[name]) for name in decision.whole}  # a rebuilt module changes its class
    for name in decision.whole:
        outcome.bound[name] = rebuild(values[name])
        note = _whole_note(plans[name], before[name], outcome.bound[name], dist.get_world_size())
        outcome.notes[name] = (before[name], note)
    outcome.failed.update(decision.failed)
    outcome.failed.update((name, "the ranks hold different DTensors under this name: not gathered")
                          for name in plans if name not in agreed)
    return _apply(results, closure, outcome)


def _apply(results: CellResults, closure: dict[str, Any], outcome: _Outcome) -> tuple[CellResults, dict[str, Any]]:
    """Rank 0: ``results`` and ``closure`` with each name bound to what it became, the failed ones listed."""
    namespace, shipped = dict(results.namespace), dict(closure)
    final, has_final = results.final, results.has_final
    for name, value in outcome.bound.items():
        if name == FINAL:
            final = value
            continue
        if name in shipped and shipped[name] is namespace.get(name):
            shipped[name] = value
        namespace[name] = value
    failed = [(name, type_name(final if name == FINAL else namespace.get(name)), why)
              for name, why in outcome.failed.items()]
    has_final = has_final and FINAL not in outcome.failed
    changed = [name for name in results.changed if name not in outcome.failed]
    return replace(results, namespace=namespace, changed=changed, final=final, has_final=has_final,
                   notes={**results.notes, **outcome.notes}, failed=[*results.failed, *failed]), shipped
