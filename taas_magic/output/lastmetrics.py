"""``taas.metrics()``: the last run's rank-0 reports, kept in the kernel.

The magic's run step (kernel/execute.py) keeps a run's reports when it ends, a failed run's
too (what it reached is worth seeing); after a search (kernel/search.py), the best trial's,
else the last to end's. The face (taas.py) reads them here at each call. This module imports
nothing: ``import taas`` imports it, in a rank too (where nothing is kept: ``[]``).
"""

from __future__ import annotations

_last: list[dict] = []  # rank 0's reports, in order, as output/board.py's Board.metrics() gives them


def keep(reports: list[dict]) -> None:
    """The kernel, once a run (or a search) ended: these are what :func:`metrics` gives now."""
    global _last
    _last = reports


def metrics() -> list[dict]:
    """The last taas run's rank-0 reports, in order: ``[{"step": 0, "loss": 1.0, ...}, ...]``."""
    return [dict(item) for item in _last]
