"""The kernel's half of one trial: its Optuna trial, its values, its objective, its pruning.

Runs in the kernel, on each trial's own run thread (its supervisor calls it) and on the search's
thread (kernel/trials/searchrun.py).

A trial's run (kernel/runs/execution.py) is given its :class:`TrialLink`, which the run's
supervisor thread calls:

- :meth:`answer` for each ``Suggest`` frame a rank sends: the first rank to ask for a name
  asks Optuna (``trial.suggest_<kind>``), and every rank that asks for it is answered with
  that value, so the ranks of one trial always agree; a name asked again with other
  arguments is refused (Optuna would raise the same);
- :meth:`reported` with rank 0's reports as they arrive: the objective's values are kept
  (the trial's curve, its last value, its lowest and highest), and where the search prunes
  they are given to Optuna (``trial.report(value, step)``); when ``trial.should_prune()`` says
  so the run is stopped at once (:meth:`pruned`, the supervisor checks it every poll).
  Optuna keeps every value it is given, copying them all at each one (its in-memory storage),
  so it is given the first ``PRUNE_DENSE * 2`` values, then every 2nd, every 4th, ... (about
  ``PRUNE_DENSE`` for each doubling of the trial's reports: a trial reporting every step for
  two days gives it some 20,000). The n-th value is given or not whatever its step, so trials
  of the same cell, which report the same steps, are compared by the pruner at the same steps.

The curve is a :class:`~taas_magic.history.SeriesHistory` (taas_magic/history.py): the
search's chart draws a few hundred points of each trial, so a trial reporting every step for
days keeps its first point, an evenly thinned past and its last ``CURVE_POINTS`` exactly, at
most twice that; its lowest and highest values are kept as they go, not read off the curve.

Every Optuna call is made under the search's lock: trials running side by side share one
study, from as many threads.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from taas_magic.history import SeriesHistory
from taas_magic.search.trial import Suggest, Suggested

CURVE_POINTS = 1000  # of a trial's objective: the last ones exactly, and at most as many before them
PRUNE_DENSE = 1000  # the objective's values given to Optuna's pruner for each doubling of a trial's reports


class TrialLink:
    def __init__(self, trial: Any, objective: str, lock: threading.Lock, prunes: bool):
        self.trial, self.number = trial, trial.number
        self.objective, self.prunes = objective, prunes
        self.values: dict[str, Any] = {}  # name -> the value every rank of this trial got
        self._asked: dict[str, tuple[str, dict]] = {}  # name -> (kind, arguments) as first asked
        # (step, objective) as rank 0 reported it, bounded (the module docstring); .count: how many
        self.curve: SeriesHistory[tuple[float, float]] = SeriesHistory(CURVE_POINTS, CURVE_POINTS)
        self._points = threading.Lock()  # the curve: added to by the trial's run thread, read by the search's
        self.lowest: float | None = None  # the objective's lowest and highest values reported
        self.highest: float | None = None
        self.metrics: list[dict] = []  # rank 0's reports as its board kept them, once its run ended (taas.metrics())
        self.started = time.monotonic()
        self.ended: float | None = None
        self._lock = lock
        self._prune = False

    @property
    def last(self) -> float | None:
        with self._points:
            return self.curve.last[1] if self.curve.count else None

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def drawn(self, most: int) -> tuple[tuple[float, float], ...]:
        """The curve as the search's chart draws it: at most ``most`` points evenly spread, the first and the last."""
        with self._points:
            return tuple(self.curve.at(index) for index in self.curve.thinned(most))

    def answer(self, rank: int, frame: Suggest) -> Suggested:
        """The trial's value for ``frame.name``: asked of Optuna once, the same for every rank."""
        asked = (frame.kind, frame.args)
        if frame.name in self.values:
            if self._asked[frame.name] != asked:
                return Suggested(frame.name, error=f"{frame.name!r} was suggested before with other arguments "
                                                    f"({self._asked[frame.name][1]}); a name has one range per trial")
            return Suggested(frame.name, self.values[frame.name])
        try:
            with self._lock:
                value = getattr(self.trial, f"suggest_{frame.kind}")(frame.name, **_optuna_args(frame))
        except Exception as exc:  # noqa: BLE001 - Optuna's refusal goes back to the rank that asked, as its error
            return Suggested(frame.name, error=f"{type(exc).__name__}: {exc}")
        self.values[frame.name], self._asked[frame.name] = value, asked
        return Suggested(frame.name, value)

    def reported(self, reports: list) -> None:
        """Rank 0's reports (step, metrics), as the board receives them."""
        for step, metrics in reports:
            value = metrics.get(self.objective)
            if value is None or not isinstance(value, (int, float)) or math.isnan(value):
                continue
            value, told = float(value), pruner_told(self.curve.count)
            with self._points:
                self.curve.append((step, value))
            self.lowest = value if self.lowest is None else min(self.lowest, value)
            self.highest = value if self.highest is None else max(self.highest, value)
            if self.prunes and not self._prune and told:
                with self._lock:
                    self.trial.report(value, max(0, int(step)))
                    self._prune = self.trial.should_prune()

    def pruned(self) -> bool:
        """The pruner said to stop this trial (the supervisor stops its ranks at once)."""
        return self._prune


def pruner_told(n: int) -> bool:
    """Whether a trial's ``n``-th objective value (from 0) is given to Optuna: all of the first
    ``2 * PRUNE_DENSE``, then every 2nd up to 4x, every 4th up to 8x, ..."""
    return n % (1 << max(0, (n // PRUNE_DENSE).bit_length() - 1)) == 0


def _optuna_args(frame: Suggest) -> dict:
    if frame.kind == "categorical":
        return {"choices": list(frame.args["choices"])}
    args = dict(frame.args)
    if frame.kind == "int" and args.get("step") is None:
        args["step"] = 1
    return args
