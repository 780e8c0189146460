"""``taas.trial()``: the trial a cell's suggestions come from, in a search or alone.

Runs wherever ``taas.trial()`` is called: in a rank, on the cell's thread (a :class:`RemoteTrial`
waits for its answer through rank/inbox.py), and in the notebook, on the kernel's cell thread (a
:class:`FixedTrial`).

Both kinds have Optuna's ``suggest_float(name, low, high, *, step=None, log=False)``,
``suggest_int(name, low, high, *, step=1, log=False)``, ``suggest_categorical(name, choices)``,
``number`` and ``params``, plus one keyword of ours, ``default=``:

- :class:`RemoteTrial`, in a rank of a search's trial (``--trials K``): each suggestion asks
  the kernel (a ``Suggest`` frame), where the trial's Optuna trial is asked once per name and
  every rank of the trial is answered with that one value (search/link.py). ``default=`` is
  not used: the sampler decides. A suggestion the kernel refuses (Optuna's error, the same
  name asked with other arguments) raises ``ValueError`` in the cell, on that line.
- :class:`FixedTrial`, anywhere else (the notebook, a rank of a plain run): each suggestion
  is its ``default=``, so the cell of a search also runs alone; a suggestion without one
  raises ``ValueError`` saying what to add. ``number`` is 0, as Optuna's ``FixedTrial``.
  A trial rank 0's cell bound comes back to the notebook as a fixed trial of its values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from taas_magic.protocol import ToKernel, ToPeer


# -- this feature's frames (protocol.py frames them, and lists every frame) --------------------
@dataclass(frozen=True)
class Suggested(ToPeer, kind="suggested"):
    """The trial's value for ``name`` (the same for every rank of the trial), or ``error``."""

    name: str
    value: Any = None
    error: str = ""


@dataclass(frozen=True)
class Suggest(ToKernel, kind="suggest"):
    """``trial.suggest_<kind>(name, ...)`` in a rank of a search's trial (search/trial.py)."""

    name: str
    kind: str  # "float", "int" or "categorical"
    args: dict  # low, high, step, log; or choices


NO_DEFAULT = object()
Ask = Callable[[Suggest], Suggested]  # send the frame, wait for the kernel's answer (rank/main.py wires it)


class _Trial:
    """The three suggestions, written once: each makes its arguments and asks :meth:`_value`."""

    number: int

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}

    def suggest_float(self, name: str, low: float, high: float, *, step: float | None = None, log: bool = False,
                      default: Any = NO_DEFAULT) -> float:
        return self._kept(name, self._value(name, "float", {"low": low, "high": high, "step": step, "log": log}, default))

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False,
                    default: Any = NO_DEFAULT) -> int:
        return self._kept(name, self._value(name, "int", {"low": low, "high": high, "step": step, "log": log}, default))

    def suggest_categorical(self, name: str, choices: Sequence[Any], *, default: Any = NO_DEFAULT) -> Any:
        return self._kept(name, self._value(name, "categorical", {"choices": tuple(choices)}, default))

    def _kept(self, name: str, value: Any) -> Any:
        self.params[name] = value
        return value

    def _value(self, name: str, kind: str, args: dict, default: Any) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<taas {type(self).__name__} {self.number} {self.params}>"

    def __reduce__(self) -> tuple:
        """A trial that leaves its rank (rank 0's names coming back) is the values it gave: a fixed trial of them."""
        return (FixedTrial, (self.number, dict(self.params)))


class RemoteTrial(_Trial):
    """A search's trial, seen from one of its ranks (see the module docstring)."""

    def __init__(self, number: int, ask: Ask):
        super().__init__()
        self.number, self._ask = number, ask

    def _value(self, name: str, kind: str, args: dict, default: Any) -> Any:
        answer = self._ask(Suggest(name, kind, args))
        if answer.error:
            raise ValueError(f"taas: trial {self.number}: suggest_{kind}({name!r}): {answer.error}")
        return answer.value


class FixedTrial(_Trial):
    """Not a search: each suggestion is its ``default=`` (see the module docstring). A trial that came
    back from a search's rank is a fixed trial of the values it gave: those names give them again."""

    def __init__(self, number: int = 0, params: dict[str, Any] | None = None):
        super().__init__()
        self.number, self._fixed = number, dict(params or {})
        self.params.update(self._fixed)

    def _value(self, name: str, kind: str, args: dict, default: Any) -> Any:
        if name in self._fixed:
            return self._fixed[name]
        call = f"suggest_{kind}({name!r}, ...)"
        if default is NO_DEFAULT:
            raise ValueError(f"taas.trial(): {call} has no default= and this cell is not a search; "
                             f"add --trials K to the pragma, or give default=... to run it alone")
        if kind == "categorical" and default not in args["choices"]:
            raise ValueError(f"taas.trial(): {call}: default={default!r} is not one of its choices {list(args['choices'])}")
        if kind != "categorical" and not args["low"] <= default <= args["high"]:
            raise ValueError(f"taas.trial(): {call}: default={default!r} is outside [{args['low']}, {args['high']}]")
        return default


_current: _Trial | None = None  # the rank's trial, once the bootstrap set it (start)


def start(number: int | None, ask: Ask) -> None:
    """In a rank, before the cell runs: a search's trial ``number`` asks through ``ask``; None: not a search."""
    global _current
    _current = RemoteTrial(number, ask) if number is not None else FixedTrial()


def trial() -> _Trial:
    """``taas.trial()``: this rank's trial in a search; else a fixed trial of defaults (a new one each call)."""
    return _current if _current is not None else FixedTrial()
