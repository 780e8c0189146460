"""The session's settings: ``TaasMagics`` traitlets, so ``%config`` and ``ipython_config.py`` work.

Runs in the kernel, on the cell's thread: ``%config`` sets a traitlet there, and it is checked as it
is set.

A setting that is the session default of a pragma option is made from that option's row
of ``options.OPTIONS`` (:func:`option_trait`): its type, its default and what it accepts
are the row's, so the two cannot drift; ``pragma.settle`` then decides a run's options
from the pragma and the session in one place. The settings no option has (how much
output a cell shows, when a closure goes through a file, how many checkpoints are kept,
the warm spares) say what they accept in :data:`SESSION_ONLY` and :class:`Warm`.

A value out of range is refused when it is set, with one message naming what is accepted
(:func:`refuse`): ``TaasMagics.ahead must be at least 2, got 1``.
"""

from __future__ import annotations

from traitlets import Bool, Enum, Float, Int, TraitError, TraitType, Unicode

from taas_magic.cell.options import SETTINGS, Choice, Count, Flag, Seconds, Size, Value, option
from taas_magic.kernel.runs.session import Warm

SESSION_ONLY: dict[str, Value] = {  # what the settings no option has accept
    "max_output_lines": Count(1),
    "max_output_bytes": Count(1),
    "tail_output_lines": Count(0),
    "closure_file_bytes": Count(0),
    "keep_checkpoints": Count(1),
    "view": Choice("auto", "widget", "stream"),
}
WARM_ACCEPTS = "'off', 'auto' or a number of spares"


def option_trait(flag: str, help: str) -> TraitType:
    """The ``TaasMagics`` setting whose value is ``flag``'s session default, made from its row."""
    row = option(flag)
    if isinstance(row.value, Choice):
        return Enum(row.value.words, row.default, config=True, help=help)
    if isinstance(row.value, Size):
        return Unicode("", config=True, help=help)  # empty: decided by the host
    if isinstance(row.value, Seconds):
        seconds = row.default
        assert seconds is None or isinstance(seconds, float), f"{flag}'s default is seconds"
        if seconds is None:
            return Float(None, allow_none=True, config=True, help=help)
        return Float(seconds, config=True, help=help)
    if isinstance(row.value, Flag):
        return Bool(bool(row.default), config=True, help=help)
    assert isinstance(row.value, Count) and isinstance(row.default, int), f"{flag} has a value kind option_trait knows"
    return Int(row.default, config=True, help=help)


VALIDATED = (*SETTINGS, *SESSION_ONLY, "warm")  # every setting refuse() checks


def refuse(name: str, value: object) -> object:
    """``value`` when setting ``name`` accepts it; otherwise TraitError naming what it accepts."""
    if name == "warm":
        try:
            Warm.parse(str(value))
        except ValueError:
            raise TraitError(f"TaasMagics.warm must be {WARM_ACCEPTS}, got {value!r}") from None
        return value
    row = SETTINGS.get(name)
    accepts = (row.value if row is not None else SESSION_ONLY[name]).refusal(value)
    if accepts is not None:
        raise TraitError(f"TaasMagics.{name} must be {accepts}, got {value!r}")
    return value
