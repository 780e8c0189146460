"""The taas cell grammar: ``#!<config>`` lines, one ``#pragma taas`` line, options.

Runs in the kernel, on the cell's thread, where the magic parses the cell's head and settles the
run's options; the frozen values it makes are read on the run's and the search's threads too.

A taas cell looks like::

    #!g2.8                         <- optional config lines, recorded and shown
    #pragma taas --gpus 8 --cpus 1 <- the pragma: must come before any code
    ...the cell body...

or, as a cell magic, ``%%taas --gpus 8`` followed by the body.

Options (each at most once; ``--opt VALUE`` or ``--opt=VALUE``) are defined once, in
the option table (cell/options.py): the parser reads the cell's head against it.

Everything here is pure: text in, a frozen :class:`PragmaOptions` or a
:class:`PragmaError` out. Nothing is launched by this module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping

from taas_magic.cell.options import AUTO, BY_FLAG, HANG_SECONDS, OPTIONS, SEARCH_ONLY, Flag, OptionalCount, PragmaError

PRAGMA_RE = re.compile(r"^\s*#\s*pragma\s+taas(?=\s|$)(?P<args>.*)$")
CONFIG_RE = re.compile(r"^\s*#!(?P<config>.*)$")

@dataclass(frozen=True)
class PragmaOptions:
    gpus: int | str  # N, or AUTO (resolved against the host by rankenv.choose_ranks before anything starts)
    device: str = AUTO  # auto: GPUs where the host has them; cpu: gloo on CPU, the ranks see no GPU; cuda: GPUs or an error
    cpus: int = 1
    units: int | None = None
    timeout: float | None = None
    hang: float | None = None  # None: the session default (30 s); 0: never
    output: str | None = None  # None: the session default (rank0 unless configured)
    cache_ram: int | None = None  # None: the session default
    ahead: int | None = None  # None: the session default
    per_host: int | None = None  # None: as many as each host has free
    place_timeout: float | None = None  # None: the session default
    restarts: int | None = None  # None: the session default (0)
    detach: bool = False  # --detach: the cell returns at once, the run goes on (kernel/runs/background.py)
    keep: bool | None = None  # --keep: the ranks stay for the next cell (kernel/runs/rankset.py); None: the session default
    trials: int | None = None  # --trials K: a search of K trials (kernel/trials/searchrun.py); None: one run
    parallel: int | None = None  # trials at a time (None: as the GPUs allow; one on a host without GPUs)
    objective: str = "loss"  # the metric rank 0 reports that judges a trial
    maximize: bool = False
    sampler: str = "tpe"  # Optuna's sampler
    prune: str = "median"  # Optuna's pruner
    study: str | None = None  # a study kept in <repository>/.taas/studies.db, continued by a rerun
    shared: tuple[str, ...] = ()  # --shared: folders every rank writes in place (writes/savers.py)
    profile: int = 0  # --profile [N]: N steps of every rank profiled (profiling/); 0: off
    configs: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class RunSettings:
    """A run's options, each decided once (:func:`settle`): the pragma's value where it gave
    one, else the session's setting, else the table's default."""

    gpus: int  # --gpus auto made a number (rankenv.choose_ranks)
    device: str
    cpus: int
    units: int | None  # None: one pass of the loader
    cache_ram: int | None  # None: decided by the host (min(4G, half of /dev/shm free))
    ahead: int
    timeout: float | None  # None: no timeout
    restarts: int
    per_host: int | None  # None: as many as each host has free
    place_timeout: float
    output: str
    detach: bool = False
    keep: bool = False  # --keep: the ranks stay for the next cell (kernel/runs/rankset.py)
    hang: float = HANG_SECONDS  # the hang line after this long in one collective (autopsy/hangline.py); 0: never
    trials: int | None = None
    parallel: int | None = None
    objective: str = "loss"
    maximize: bool = False
    sampler: str = "tpe"
    prune: str = "median"
    study: str | None = None
    shared: tuple[str, ...] = ()  # --shared, as written: the plan resolves them against the repository
    profile: int = 0  # --profile N: the steps profiled after the first (profiling/); 0: off
    configs: tuple[str, ...] = ()


@dataclass(frozen=True)
class TaasCell:
    """A parsed taas cell: its options and its body with the person's line numbers kept.

    ``source`` is the whole cell as the person sees it (head lines included), so that
    line ``k`` of ``source`` is line ``k`` of the cell in the notebook. The head lines
    are comments in Python, so ``source`` can be compiled as it is.
    """

    options: PragmaOptions
    source: str


def is_pragma_line(line: str) -> bool:
    return PRAGMA_RE.match(line) is not None


def settle(options: PragmaOptions, session: Mapping[str, object], ranks: int) -> RunSettings:
    """The run's settings: the pragma over the session over the defaults, ``ranks`` for ``--gpus``.

    ``session`` holds the ``TaasMagics`` value of every option that has a setting (already
    validated by :func:`setting_refusal`).
    """
    values: dict[str, object] = {}
    for row in OPTIONS:
        value = getattr(options, row.field)
        if value is None and row.setting is not None:
            value = row.value.from_setting(session[row.setting])
        values[row.field] = row.default if value is None else value
    values["gpus"] = ranks
    if values["trials"] is not None:
        values["keep"] = False  # a search's trials start their own ranks: TaasMagics.keep is for plain cells
    return RunSettings(configs=options.configs, **values)  # type: ignore[arg-type]  # each row holds its field's type


def parse_options(args: str, configs: tuple[str, ...] = ()) -> PragmaOptions:
    """Parse the option part of a pragma (everything after ``#pragma taas``)."""
    tokens = args.split()
    values: dict[str, object] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, inline = token.partition("=")
        if name not in BY_FLAG:
            if token.startswith("-"):
                raise PragmaError(f"unknown option {token!r}")
            raise PragmaError(f"unexpected token {token!r} (options start with --)")
        if name in values:
            raise PragmaError(f"duplicate option {name!r}")
        if isinstance(BY_FLAG[name].value, Flag):
            if eq:
                BY_FLAG[name].parse(inline)  # raises: a flag takes no value
            values[name] = True
            i += 1
            continue
        value = BY_FLAG[name].value
        if isinstance(value, OptionalCount) and not eq and (i + 1 >= len(tokens) or tokens[i + 1].startswith("--")):
            values[name] = value.bare  # --profile alone
            i += 1
            continue
        if eq:
            if not inline:
                raise PragmaError(f"{name} needs a value, got {token!r}")
            raw = inline
            i += 1
        else:
            if i + 1 >= len(tokens) or tokens[i + 1].startswith("--"):
                raise PragmaError(f"{name} needs a value")
            raw = tokens[i + 1]
            i += 2
        values[name] = BY_FLAG[name].parse(raw)
    for option in OPTIONS:
        if option.required and option.flag not in values:
            raise PragmaError(f"{option.flag} {option.metavar} is required")
    _check_search(values)
    fields = {BY_FLAG[flag].field: value for flag, value in values.items()}
    return PragmaOptions(configs=configs, **fields)  # type: ignore[arg-type]  # each parser returns its field's type


def _check_search(values: dict[str, object]) -> None:
    """The search's options mean something only in a search; a search is not detached (yet)."""
    if "--trials" not in values:
        alone = [flag for flag in SEARCH_ONLY if flag in values]
        if alone:
            raise PragmaError(f"{alone[0]} belongs to a search: add --trials K")
    elif "--detach" in values:
        raise PragmaError("--detach with --trials: a search runs in its cell (interrupt it to stop every trial)")
    elif "--keep" in values:
        raise PragmaError("--keep with --trials: every trial starts its own ranks, and none is kept")
    elif "--profile" in values:
        raise PragmaError("--profile with --trials: profile one run of the cell, without --trials")


def _config_name(line: str, lineno: int) -> str:
    match = CONFIG_RE.match(line)
    assert match is not None, "called only for lines CONFIG_RE matched"
    config = match.group("config").strip()
    if not config or " " in config:
        raise PragmaError(f"bad config line {line.strip()!r} on line {lineno} (expected e.g. #!g2.8)")
    return config


def _check_no_more_pragmas(lines: list[str], start: int, why: str) -> None:
    for index in range(start, len(lines)):
        if is_pragma_line(lines[index]):
            raise PragmaError(f"{why}: {lines[index].strip()!r} on line {index + 1}")


def parse_cell(cell: str, magic_args: str | None = None) -> TaasCell:
    """Parse a whole taas cell.

    Args:
        cell: the cell text. For the pragma form it starts with the ``#!``/``#pragma``
            head; for the ``%%taas ARGS`` form it is the body below the magic line.
        magic_args: the ``%%taas`` line's arguments, or ``None``/blank for the pragma form.

    Raises:
        PragmaError: the head or the options are malformed.
    """
    lines = cell.splitlines()
    configs: list[str] = []
    if magic_args is not None and magic_args.strip():
        # %%taas ARGS form: the body may open with #! lines, and must hold no pragma.
        index = 0
        while index < len(lines) and (not lines[index].strip() or CONFIG_RE.match(lines[index])):
            if lines[index].strip():
                configs.append(_config_name(lines[index], index + 2))
            index += 1
        _check_no_more_pragmas(lines, 0, "two pragmas (the %%taas line is one)")
        options = parse_options(magic_args, tuple(configs))
        # Line 1 of the cell is the %%taas line: keep the body's numbering as the person sees it.
        return TaasCell(options, "#%%taas " + magic_args.strip() + "\n" + cell)

    index = 0
    while index < len(lines):
        line = lines[index]
        if not line.strip():
            index += 1
        elif CONFIG_RE.match(line):
            configs.append(_config_name(line, index + 1))
            index += 1
        else:
            break
    if index >= len(lines) or not is_pragma_line(lines[index]):
        for later in range(index, len(lines)):
            if is_pragma_line(lines[later]):
                raise PragmaError(
                    f"the #pragma taas line must come before any code, found on line {later + 1}: "
                    f"{lines[later].strip()!r}"
                )
        raise PragmaError("no #pragma taas line at the top of the cell")
    pragma_index = index
    _check_no_more_pragmas(lines, pragma_index + 1, "two pragmas in one cell")
    pragma = PRAGMA_RE.match(lines[pragma_index])
    assert pragma is not None, "is_pragma_line said so"
    args = pragma.group("args")
    options = parse_options(args, tuple(configs))
    # Blank lines above the pragma become empty comments so that IPython's
    # leading_empty_lines cleanup cannot shift the person's line numbers.
    head = ["#" if not line.strip() else line for line in lines[:pragma_index]]
    source = "\n".join(head + lines[pragma_index:])
    if cell.endswith("\n"):
        source += "\n"
    return TaasCell(options, source)
