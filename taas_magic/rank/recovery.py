"""What a failed kept cell leaves half done in the models it trained, put back before the next cell.

Runs in each kept rank, on its main thread, before the next cell's code, after a failed or interrupted cell's groups
got their new communicator (rank/betweencells.py's ``renew_groups``, rank/abortable.py).

A cell that stops between a model's forward and its backward, or inside either, leaves per-iteration state that the
next step would trip on, differently on each rank, so their next collectives would not match:

- FSDP2 (``fully_shard``): each root module's iteration state is reset by its own public
  ``FSDPModule.reset_iter_state()`` (torch: "after an exception aborted a forward or backward mid-flight"): its
  in-flight all-gathers and reduce-scatters dropped, every parameter group resharded, the failed step's gradients
  lost;
- DDP: a backward that the failure cut short has finished on every rank (its all-reduce ended, with the rank's own
  gradients: rank/abortable.py), so its reducer is ready for the next forward; nothing to do.

Models are found by a walk of the garbage collector's objects, once per failed cell, and only when the module that
defines them was imported (a rank that never used FSDP2 pays nothing).
"""

from __future__ import annotations

import gc
import sys
import warnings

FSDP = "torch.distributed.fsdp"


def reset_models() -> list[str]:
    """Every FSDP2 root module's iteration state reset; what could not be, one line each (its class and why)."""
    fsdp = sys.modules.get(FSDP)
    module_class = getattr(fsdp, "FSDPModule", None)
    if module_class is None:
        return []
    problems = []
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore")
        roots = [found for found in gc.get_objects() if isinstance(found, module_class)]
    for found in roots:
        state = found._get_fsdp_state()  # private API: see taas_magic/private.py
        if not getattr(state, "_is_root", False):
            continue  # a non-root module: its root resets it (a root not run yet has nothing to reset)
        try:
            found.reset_iter_state()
        except Exception as error:  # noqa: BLE001 - said in the next cell, the model named
            problems.append(f"{type(found).__name__}: FSDP2's reset_iter_state() raised {type(error).__name__}: {error}")
    return problems
