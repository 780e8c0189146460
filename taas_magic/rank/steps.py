"""Where a training step ends in this rank: the outermost ``optimizer.step`` of the cell's pacing optimizer.

Runs in each rank: installed once, when ``torch.optim`` is first imported (rank/main.py); its listeners are called
on the thread that steps (the cell's, in practice). Two features count steps, and both listen here: the straggler
line's steps (output/collectives.py) and ``--profile``'s window marks (profiling/window.py). One pair of global
hooks (``register_optimizer_step_pre_hook`` / ``..._post_hook``) is installed for the rank's life; a listener
is a plain function added once (removing a hook while torch runs them once broke a cell's own hook).

A step is:

- only the outermost call: a wrapper optimizer (Lookahead, ``ZeroRedundancyOptimizer``) whose ``step`` calls its
  inner optimizer's is one step, not two (the pre hook notes the optimizer whose step began first; only its end
  counts);
- of one optimizer, the first to step in the cell (the *pacer*): a cell with two optimizers (a GAN's generator
  and discriminator) steps each once an iteration, and that is one step. Each cell chooses afresh.

A step that raises is not counted; the same optimizer's next step, or the pacer's, ends what it began (and a new
cell forgets it).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

listeners: list[Callable[[], None]] = []  # called at each step, in order


class _Steps:
    outer: Any = None  # the optimizer whose step began while no other's was under way (a wrapper, not its inner one)
    pacer: weakref.ref | None = None  # the optimizer whose steps count in this cell
    hooks: tuple = ()  # torch's handles of the two hooks


def install(optimizer_module: Any) -> None:
    """``torch.optim.optimizer`` was imported: count its steps from now on (once per rank)."""
    _Steps.hooks = (optimizer_module.register_optimizer_step_pre_hook(_entered),
                    optimizer_module.register_optimizer_step_post_hook(_left))


def uninstall() -> None:
    """The hooks removed (a test's process, which outlives the rank it plays)."""
    for hook in _Steps.hooks:
        hook.remove()
    _Steps.hooks = ()


def new_cell() -> None:
    """A cell starts: its first optimizer to step paces it; what a raising step left is forgotten."""
    _Steps.outer, _Steps.pacer = None, None


def _entered(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    pacer = _Steps.pacer() if _Steps.pacer is not None else None
    # the pacer is an outermost optimizer (its end counted before): another noted as outer is one whose step raised
    if _Steps.outer is None or (optimizer is pacer and _Steps.outer is not pacer):
        _Steps.outer = optimizer


def _left(optimizer: Any, _args: Any, _kwargs: Any) -> None:
    if optimizer is not _Steps.outer:
        return  # an inner optimizer's step, inside its wrapper's
    _Steps.outer = None
    pacer = _Steps.pacer() if _Steps.pacer is not None else None
    if pacer is None:
        _Steps.pacer, pacer = weakref.ref(optimizer), optimizer
    if pacer is not optimizer:
        return
    for listener in tuple(listeners):  # a copy: a listener may change the list while it runs
        listener()
