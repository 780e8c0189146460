"""The default process group outlives the cell while its sharded names are gathered.

Cells end with ``dist.destroy_process_group()``, but the ranks gather rank 0's sharded names
after the cell (transfer/sharded.py), over that group. So in a rank, once ``torch.distributed``
is imported (:func:`defer_destroy`, installed by rank/main.py), ``destroy_process_group()`` of
the default group, in a cell that has imported ``torch.distributed.tensor`` (FSDP2 and DTensor
import it), only notes that it was asked for; :func:`finish_destroy` does it for real once the
gather is done. An ``init_process_group`` after a deferred destroy does the destroy first, so a
cell that destroys and starts again works as before. Any other group, and any cell that never
imported DTensor, is destroyed at once, as without taas.

Kept ranks (``--keep``, :func:`keep_across_cells`) keep their default group from cell to cell: there a
cell's ``init_process_group`` while the group exists and its ``destroy_process_group`` of the default
group do nothing, so a cell written for fresh ranks runs unchanged in kept ones. On CPU their gloo group is
rank/abortable.py's, which a failed cell does not end (``init_process_group('gloo')``, or with no backend, makes
it; so do the subgroups of its default backend, ``new_group`` and a ``DeviceMesh``'s, and a ``new_group`` that
names gloo).

A group made while another rank is at a pdb prompt is held at once, as the groups made before (rank/cellpdb.py).

Runs in each rank: on the cell's thread (the wrappers), and on the rank's main thread after the cell.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from types import ModuleType
from typing import Any, Callable

from taas_magic.rank import cellpdb

DTENSOR = "torch.distributed.tensor"

_destroy: Callable[[], Any] | None = None  # the default group's destroy, asked for and deferred
_kept = False  # the ranks are kept across cells: the default group stays
_abortable = False  # kept ranks on CPU: gloo is rank/abortable.py's group
GLOO_NAMES = (None, "gloo", "cpu:gloo")  # what init_process_group's backend may be for gloo on CPU


def keep_across_cells(abortable: bool) -> None:
    """From now on the cells' init and destroy of the default group do no harm, and (``abortable``: on CPU) their
    gloo groups outlive a failed cell (see the module docstring)."""
    global _kept, _abortable
    _kept, _abortable = True, abortable


def join_survivors(after: str) -> None:
    """A new process in a dead kept rank's place (on CPU): its default group made now, joining the survivors' as
    they renew it after the run ``after`` (rank/abortable.py)."""
    import torch.distributed as dist

    from taas_magic.rank import abortable

    abortable.register()
    abortable.join_after(after)
    dist.init_process_group(backend=abortable.BACKEND)
    match_survivors()


def rehome_default_group() -> None:
    """Rank 0 died and was replaced: its new process hosts a new rendezvous store where the old one was
    (MASTER_ADDR:MASTER_PORT). A survivor connects to it, and the default group's next communicator and the store
    ``new_group`` makes groups on are made on it, under the prefixes ``init_process_group`` gives them: those the
    new rank 0's own ``init_process_group`` uses."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from taas_magic.rank import abortable

    group = abortable.default_group()
    if group is None:
        return
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=group.size(),
                           is_master=False, timeout=group.timeout)
    named = dist.PrefixStore(f"{group.group_name}/", dist.PrefixStore("default_pg", client))
    world = distributed_c10d._world  # private API: see taas_magic/private.py
    backend, _ = world.pg_map[group]
    world.pg_map[group] = (backend, named)
    group.rehome(dist.PrefixStore("cpu/", named))


def match_survivors() -> None:
    """Every kept rank, once a dead rank's new process joined the default group: the new one imports DTensor if the
    others have (after each cell a rank gathers sharded names, a collective, only once DTensor is imported:
    transfer/sharded.py), and takes their count of groups made (which names the next one: a ``new_group`` must
    have one name on every rank)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world  # private API: see taas_magic/private.py
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (DTENSOR in sys.modules, world.group_count))
    if any(imported for imported, _ in everyone):
        importlib.import_module(DTENSOR)
    world.group_count = max(count for _, count in everyone)


def defer_destroy(dist: ModuleType) -> None:
    """Wrap ``dist.destroy_process_group``, ``dist.init_process_group`` and ``dist.new_group`` (see the module
    docstring)."""
    original, init, new_group = dist.destroy_process_group, dist.init_process_group, getattr(dist, "new_group", None)
    if getattr(original, "__taas_deferred__", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        global _destroy
        if _kept and (group is None or group is dist.group.WORLD):
            return None  # the kept ranks' group: the next cell uses it
        if (group is None or group is dist.group.WORLD) and DTENSOR in sys.modules and dist.is_initialized():
            _destroy = original
            return None
        return original(group)

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if _kept and dist.is_initialized():
            return None  # made by an earlier cell of these kept ranks: the same group
        finish_destroy()
        if _abortable:
            args, kwargs = _abortable_gloo(args, kwargs, 0, default_too=True)
        made = init(*args, **kwargs)
        cellpdb.group_made()  # held at once if another rank is at a prompt
        return made

    def new_group_of(*args: Any, **kwargs: Any) -> Any:
        if _abortable:  # gloo named: abortable too (no backend named: the default group's, abortable already)
            args, kwargs = _abortable_gloo(args, kwargs, 2, default_too=False)
        assert new_group is not None
        return new_group(*args, **kwargs)

    destroy_process_group.__taas_deferred__ = True  # type: ignore[attr-defined]  # a marker: wrapped once only
    wrappers: dict[str, Callable[..., Any]] = {"destroy_process_group": destroy_process_group,
                                              "init_process_group": init_process_group}
    if new_group is not None:  # (a stand-in module may have none)
        wrappers["new_group"] = new_group_of
    for name, wrapper in wrappers.items():
        setattr(dist, name, wrapper)  # on the module the cell calls them from, as rank/devices.py does


def _abortable_gloo(args: tuple, kwargs: dict, position: int, default_too: bool) -> tuple[tuple, dict]:
    """A group maker's arguments (its backend at ``position``) with gloo (named, or none named if ``default_too``:
    the default on CPU) as rank/abortable.py's backend."""
    from taas_magic.rank import abortable

    named = kwargs.get("backend", args[position] if len(args) > position else None)
    if named is None and not default_too or not (named is None or isinstance(named, str) and named.lower() in GLOO_NAMES):
        return args, kwargs
    abortable.register()
    if len(args) > position:
        return (*args[:position], abortable.BACKEND, *args[position + 1:]), kwargs
    return args, {**kwargs, "backend": abortable.BACKEND}


def finish_destroy() -> None:
    """The deferred destroy, done now (nothing when none waits)."""
    global _destroy
    destroy, _destroy = _destroy, None
    if destroy is not None:
        destroy()
