"""In a rank other than 0: its view of the repository made again wherever a program may rely on rank 0's writes.

Runs in each rank whose writes go to an overlay (writes/namespace.py): :func:`follow_collectives` is installed
by rank/main.py when the cell imports ``torch.distributed``; the refresh then runs on whichever thread
returns from a collective, and on the rank's main thread as each cell begins (:func:`refresh`).

``if rank == 0: prepare(); dist.barrier(); load()`` is in nearly every distributed program (a dataset
download, a tokenizer cache, ``main_process_first``, a checkpoint resume). Under the overlay, rank 1's view
would keep what it saw before rank 0's change (namespace.py says why), and the ranks would take different
branches. So every point where the ranks meet is also a point where rank 1's view becomes the repository as
rank 0 has left it:

- **after every collective** the cell calls through ``torch.distributed`` (:data:`COLLECTIVES`: barriers,
  broadcasts, reductions, gathers, scatters, point-to-point), whether the cell calls it or a library does
  (DCP's planning, accelerate's ``wait_for_everyone``, Lightning's ``barrier``);
- **at every cell's start**, for kept ranks (rank 0 may have written in the cell before, or in the notebook).

What it covers: paths rank 1 looked up before they existed, changes in place, deletions, renames
(``os.replace`` onto an existing name too). The rank's own diverted writes stay, and still shadow only the
paths it wrote: where it and rank 0 both wrote a path, it sees its own (a folder both made shows both
ranks' entries). Not covered: a collective with ``async_op=True`` is a refresh as the call returns, not at
its ``wait()``; collectives made below Python (DDP's gradient all-reduce, FSDP2's and functional
collectives) are none, which costs nothing: a program never hands files over there. The Python fallback
(writes/divert.py) reads the repository itself on every call and needs none of this.

The cost: one refresh is a mount and a ``move_mount`` (about 0.5 ms), in ranks other than 0 only, for each
collective called from Python; ``bench/view.py`` measures it. A refresh that fails (the host refused the
mount) is said once on the rank's stderr, and the rank goes on with the view it has.
"""

from __future__ import annotations

import functools
import sys
import threading
from types import ModuleType
from typing import Any, Callable

from taas_magic.writes import namespace

COLLECTIVES = (
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "all_reduce", "all_reduce_coalesced",
    "reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_gather_coalesced", "gather",
    "gather_object", "scatter", "scatter_object_list", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "send", "recv", "send_object_list", "recv_object_list", "batch_isend_irecv",
)

_lock = threading.Lock()  # one refresh at a time (a save's thread and the cell's can both return from one)
_failed = False  # the host refused a refresh once: said, and not tried again


def refresh() -> None:
    """The repository as it is now, in this process's view (nothing where the view is not an overlay)."""
    global _failed
    if _failed or not namespace.mounted():
        return
    with _lock:
        try:
            namespace.remount()
        except OSError as exc:
            _failed = True
            print(f"taas: this rank's view of the repository can no longer follow rank 0's writes ({exc}); "
                  "what rank 0 writes from now on may not be seen here", file=sys.stderr, flush=True)


def follow_collectives(dist: ModuleType) -> None:
    """Wrap every collective of ``torch.distributed`` (``dist``) and of its ``distributed_c10d`` so that it
    returns with the view refreshed (only where this process's view is an overlay: rank 0 and the Python
    fallback pay nothing)."""
    if not namespace.mounted():
        return
    wrappers: dict[Any, Callable[..., Any]] = {}  # one wrapper per function, wherever it is found
    for module in (dist, sys.modules.get("torch.distributed.distributed_c10d")):
        for name in COLLECTIVES if module is not None else ():
            original = getattr(module, name, None)
            if original is not None and not getattr(original, "__taas_view__", False):
                if original not in wrappers:
                    wrappers[original] = _refreshing(original)
                setattr(module, name, wrappers[original])


def _refreshing(collective: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(collective)
    def after_it_the_view_is_refreshed(*args: Any, **kwargs: Any) -> Any:
        result = collective(*args, **kwargs)
        refresh()
        return result

    after_it_the_view_is_refreshed.__taas_view__ = True  # type: ignore[attr-defined]  # wrapped once only
    return after_it_the_view_is_refreshed
