"""The grid of ``--sampler grid``, read from the cell's own suggestions.

Runs in the kernel, on the cell's thread, as the search is planned (kernel/trials/searchplan.py).

Optuna's ``GridSampler`` must be given its grid before the first trial, but a cell asks for
its values as it runs (define-by-run). The cell's text says them: :func:`grid_space` reads
every ``<anything>.suggest_categorical/int/float(...)`` call whose arguments are literals and
makes each one's values: a categorical's choices, an int's ``range(low, high + 1, step)``, a
float's ``low, low + step, ..., high`` (a float needs ``step=``). A suggestion whose arguments
are not literals, a float without a step, or one name with two different ranges is a
:class:`SearchError` naming it, before anything starts.
"""

from __future__ import annotations

import ast
import math
from typing import Any

from taas_magic.errors import SearchError

KINDS = ("float", "int", "categorical")
MOST_POINTS = 100_000


def grid_space(tree: ast.AST) -> dict[str, list[Any]]:
    """Name -> its grid values, from every suggestion call in ``tree`` (see the module docstring)."""
    space: dict[str, list[Any]] = {}
    for node in ast.walk(tree):
        kind = _suggestion_kind(node)
        if kind is None:
            continue
        assert isinstance(node, ast.Call)
        call = ast.unparse(node)
        try:
            args = [ast.literal_eval(arg) for arg in node.args]
            kwargs = {keyword.arg: ast.literal_eval(keyword.value) for keyword in node.keywords if keyword.arg}
        except ValueError:
            raise SearchError(f"taas: --sampler grid reads its grid from the cell, and `{call}` has arguments "
                              f"that are not literal values; write them out, or use --sampler tpe|random") from None
        name, values = _values(kind, args, kwargs, call)
        if name in space and space[name] != values:
            raise SearchError(f"taas: --sampler grid: {name!r} is suggested twice with different values (`{call}`)")
        space[name] = values
    if not space:
        raise SearchError("taas: --sampler grid found no trial.suggest_*(...) call in the cell to make its grid from")
    if math.prod(len(values) for values in space.values()) > MOST_POINTS:
        raise SearchError(f"taas: --sampler grid: the grid has more than {MOST_POINTS:,} points; use --sampler tpe|random")
    return space


def grid_points(space: dict[str, list[Any]]) -> int:
    return math.prod(len(values) for values in space.values())


def every_point_asked(trials: list[Any], space: dict[str, list[Any]]) -> bool:
    """Whether the study's ``trials`` (running or ended) were given every point of the grid ``space``.

    IMPORTANT: Optuna's ``GridSampler.is_exhausted`` counts a point only once its trial ended;
    asked again while the last points still run (trials side by side), the sampler gives a
    running point a second time. A trial's point is its ``grid_id`` system attribute, counted
    where its ``search_space`` is this grid (a continued ``--study`` may hold other grids')."""
    asked = {trial.system_attrs["grid_id"] for trial in trials
             if "grid_id" in trial.system_attrs and trial.system_attrs.get("search_space") == space}
    return len(asked) >= grid_points(space)


def _suggestion_kind(node: ast.AST) -> str | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    attribute = node.func.attr
    if not attribute.startswith("suggest_") or attribute.removeprefix("suggest_") not in KINDS:
        return None
    return attribute.removeprefix("suggest_")


def _values(kind: str, args: list, kwargs: dict, call: str) -> tuple[str, list[Any]]:
    names = {"categorical": ("name", "choices"), "int": ("name", "low", "high"), "float": ("name", "low", "high")}[kind]
    given = dict(zip(names, args)) | {key: value for key, value in kwargs.items() if key != "default"}
    missing = [name for name in names if name not in given]
    if missing or not isinstance(given["name"], str):
        raise SearchError(f"taas: --sampler grid cannot read `{call}`: it needs a name and "
                          f"{', '.join(names[1:])} as literal values")
    if kind == "categorical":
        return given["name"], list(given["choices"])
    low, high = given["low"], given["high"]
    if kind == "int":
        return given["name"], list(range(low, high + 1, given.get("step", 1) or 1))
    step = given.get("step")
    if not step:
        raise SearchError(f"taas: --sampler grid needs step= in `{call}`: a float range has no grid without one")
    count = int(math.floor((high - low) / step + 1e-9)) + 1
    return given["name"], [round(low + index * step, 12) for index in range(count)]
