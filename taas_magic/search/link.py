"""The kernel's half of one trial: its Optuna trial, its values, its objective, its pruning.

A trial's run (kernel/execute.py) is given its :class:`TrialLink`, which the run's
supervisor thread calls:

- :meth:`answer` for each ``Suggest`` frame a rank sends: the first rank to ask for a name
  asks Optuna (``trial.suggest_<kind>``), and every rank that asks for it is answered with
  that value, so the ranks of one trial always agree; a name asked again with other
  arguments is refused (Optuna would raise the same);
- :meth:`reported` with rank 0's reports as they arrive: the objective's values are kept
  (the trial's curve, its last value), and where the search prunes each is given to
  Optuna (``trial.report(value, step)``); when ``trial.should_prune()`` says so the run is
  stopped at once (:meth:`pruned`, the supervisor checks it every poll).

Every Optuna call is made under the search's lock: trials running side by side share one
study, from as many threads.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from taas_magic.protocol import Suggest, Suggested


class TrialLink:
    def __init__(self, trial: Any, objective: str, lock: threading.Lock, prunes: bool):
        self.trial, self.number = trial, trial.number
        self.objective, self.prunes = objective, prunes
        self.values: dict[str, Any] = {}  # name -> the value every rank of this trial got
        self._asked: dict[str, tuple[str, dict]] = {}  # name -> (kind, arguments) as first asked
        self.curve: list[tuple[float, float]] = []  # (step, objective) as rank 0 reported it
        self.metrics: list[dict] = []  # all of rank 0's reports, once its run ended (taas.metrics() of the best)
        self.started = time.monotonic()
        self.ended: float | None = None
        self._lock = lock
        self._prune = False

    @property
    def last(self) -> float | None:
        return self.curve[-1][1] if self.curve else None

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

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
            self.curve.append((step, float(value)))
            if self.prunes and not self._prune:
                with self._lock:
                    self.trial.report(float(value), max(0, int(step)))
                    self._prune = self.trial.should_prune()

    def pruned(self) -> bool:
        """The pruner said to stop this trial (the supervisor stops its ranks at once)."""
        return self._prune


def _optuna_args(frame: Suggest) -> dict:
    if frame.kind == "categorical":
        return {"choices": list(frame.args["choices"])}
    args = dict(frame.args)
    if frame.kind == "int" and args.get("step") is None:
        args["step"] = 1
    return args
