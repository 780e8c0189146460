"""The taas cell grammar: ``#!<config>`` lines, one ``#pragma taas`` line, options.

A taas cell looks like::

    #!g2.8                         <- optional config lines, recorded and shown
    #pragma taas --gpus 8 --cpus 1 <- the pragma: must come before any code
    ...the cell body...

or, as a cell magic, ``%%taas --gpus 8`` followed by the body.

Options (each at most once; ``--opt VALUE`` or ``--opt=VALUE``) are defined once, in
:data:`OPTIONS`: the parser, the usage line, ``%taas help`` and the README's table are
all made from (or checked against) that table.

Everything here is pure: text in, a frozen :class:`PragmaOptions` or a
:class:`PragmaError` out. Nothing is launched by this module.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from IPython.core.error import UsageError

PRAGMA_RE = re.compile(r"^\s*#\s*pragma\s+taas(?=\s|$)(?P<args>.*)$")
CONFIG_RE = re.compile(r"^\s*#!(?P<config>.*)$")

OUTPUT_MODES = ("rank0", "all")
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "halving", "none")
DEVICES = ("auto", "cpu", "cuda")
AUTO = "auto"  # --gpus auto: one rank per GPU of this host (2 CPU ranks where there is none)
MAX_CPUS = 8
MAX_RESTARTS = 100

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(i?b)?$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class PragmaError(UsageError):
    """A malformed taas cell head. The message names the bad token; nothing is launched."""

    def __init__(self, message: str):
        super().__init__(f"taas: {message}\n{usage()}")
        self.reason = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.reason,))

    def _render_traceback_(self) -> list[str]:
        # IPython shortens only exact UsageErrors; a subclass says how to show itself.
        return [f"UsageError: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]


@dataclass(frozen=True)
class PragmaOptions:
    gpus: int | str  # N, or AUTO (resolved against the host by rankenv.choose_ranks before anything starts)
    device: str = AUTO  # auto: GPUs where the host has them; cpu: gloo on CPU, the ranks see no GPU; cuda: GPUs or an error
    cpus: int = 1
    units: int | None = None
    timeout: float | None = None
    output: str | None = None  # None: the session default (rank0 unless configured)
    cache_ram: int | None = None  # None: the session default
    ahead: int | None = None  # None: the session default
    per_host: int | None = None  # None: as many as each host has free
    place_timeout: float | None = None  # None: the session default
    restarts: int | None = None  # None: the session default (0)
    detach: bool = False  # --detach: the cell returns at once, the run goes on (kernel/background.py)
    trials: int | None = None  # --trials K: a search of K trials (kernel/search.py); None: one run
    parallel: int | None = None  # trials at a time (None: as the GPUs allow; one on a host without GPUs)
    objective: str = "loss"  # the metric rank 0 reports that judges a trial
    maximize: bool = False
    sampler: str = "tpe"  # Optuna's sampler
    prune: str = "median"  # Optuna's pruner
    study: str | None = None  # a study kept in <repository>/.taas/studies.db, continued by a rerun
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
    trials: int | None = None
    parallel: int | None = None
    objective: str = "loss"
    maximize: bool = False
    sampler: str = "tpe"
    prune: str = "median"
    study: str | None = None
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


class Count:
    """A whole number in ``least..most`` (no upper bound when ``most`` is None)."""

    def __init__(self, least: int, most: int | None = None):
        self.least, self.most = least, most

    def parse(self, flag: str, token: str) -> int:
        try:
            value = int(token, 10)
        except ValueError:
            raise PragmaError(f"{flag} needs an integer, got {token!r}") from None
        if not self._within(value):
            bound = f"{self.least}..{self.most}" if self.most is not None else f">= {self.least}"
            raise PragmaError(f"{flag} must be {bound}, got {token!r}")
        return value

    def _within(self, value: int) -> bool:
        return value >= self.least and (self.most is None or value <= self.most)

    def refusal(self, value: object) -> str | None:
        if isinstance(value, int) and self._within(value):
            return None
        return f"{self.least}..{self.most}" if self.most is not None else f"at least {self.least}"

    def from_setting(self, value: object) -> object:
        return value


class Seconds:
    """A positive, finite number of seconds."""

    def parse(self, flag: str, token: str) -> float:
        try:
            value = float(token)
        except ValueError:
            raise PragmaError(f"{flag} needs a number of seconds, got {token!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise PragmaError(f"{flag} must be a positive number of seconds, got {token!r}")
        return value

    def refusal(self, value: object) -> str | None:
        accepted = value is None or (isinstance(value, (int, float)) and value > 0)
        return None if accepted else "a positive number of seconds"

    def from_setting(self, value: object) -> object:
        return value


class Size:
    """A size in bytes, ``512M``, ``4G`` (a setting's empty string: decided by the host)."""

    def parse(self, flag: str, token: str) -> int:
        value = parse_size(token)
        if value is None:
            raise PragmaError(f"{flag} needs a size such as 512M or 4G, got {token!r}")
        return value

    def refusal(self, value: object) -> str | None:
        accepted = isinstance(value, str) and (not value or parse_size(value) is not None)
        return None if accepted else "a size such as 512M or 4G (or empty: automatic)"

    def from_setting(self, value: object) -> object:
        return parse_size(value) if isinstance(value, str) and value else None


class Choice:
    """One word of a fixed few."""

    def __init__(self, *words: str):
        self.words = words

    def parse(self, flag: str, token: str) -> str:
        if token not in self.words:
            raise PragmaError(f"{flag} must be one of {', '.join(self.words)}, got {token!r}")
        return token

    def refusal(self, value: object) -> str | None:
        return None if value in self.words else f"one of {', '.join(self.words)}"

    def from_setting(self, value: object) -> object:
        return value


class RankCount(Count):
    """``--gpus``: N >= 1, or AUTO (resolved against the host or the cluster before anything starts)."""

    def __init__(self) -> None:
        super().__init__(1)

    def parse(self, flag: str, token: str) -> int | str:  # type: ignore[override]  # AUTO too
        return AUTO if token == AUTO else super().parse(flag, token)


class Flag:
    """An option that takes no value: present or not."""

    def parse(self, flag: str, token: str) -> bool:
        raise PragmaError(f"{flag} takes no value, got {token!r}")

    def refusal(self, value: object) -> str | None:
        return None if isinstance(value, bool) else "True or False"

    def from_setting(self, value: object) -> object:
        return value


class Name:
    """A name: letters, digits, ``_``, ``-`` and ``.`` (a metric's, a study's)."""

    PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")

    def parse(self, flag: str, token: str) -> str:
        if not self.PATTERN.match(token):
            raise PragmaError(f"{flag} needs a name of letters, digits, _, - and ., got {token!r}")
        return token

    def refusal(self, value: object) -> str | None:
        return None if isinstance(value, str) and self.PATTERN.match(value) else "a name"

    def from_setting(self, value: object) -> object:
        return value


def parse_size(token: str) -> int | None:
    """``4G``, ``512MiB``, ``1.5g``, ``1000`` -> bytes (K/M/G/T are powers of 1024); None if malformed."""
    match = _SIZE.match(token.strip())
    if match is None:
        return None
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


Value = Union[Count, Seconds, Size, Choice, Flag, Name]


@dataclass(frozen=True)
class Option:
    """One pragma option: its flag, what its value is called, the field it sets, and its help;
    its default, and the ``TaasMagics`` setting (``%config``) that replaces that default for a
    session, if it has one."""

    flag: str
    metavar: str
    field: str
    value: Value
    help: str
    required: bool = False
    default: object = None
    setting: str | None = None

    def parse(self, token: str) -> object:
        return self.value.parse(self.flag, token)

    @property
    def signature(self) -> str:
        """``--gpus N|auto``; a flag alone, ``--detach``."""
        return f"{self.flag} {self.metavar}".strip()


OPTIONS: tuple[Option, ...] = (
    Option("--gpus", "N|auto", "gpus", RankCount(),
           "required, N >= 1 or auto: the number of ranks, one per GPU (CPU + gloo where the host has no GPU); "
           "auto: one per GPU of this host, 2 CPU ranks where it has none", required=True),
    Option("--device", "auto|cpu|cuda", "device", Choice(*DEVICES),
           "auto (default): the host's GPUs if it has any, else CPU; cpu: CPU ranks with gloo even where GPUs exist "
           "(the ranks see none); cuda: GPUs, an error where there are none", default=AUTO),
    Option("--cpus", "M", "cpus", Count(1, MAX_CPUS),
           f"1..{MAX_CPUS}, default 1: data workers preparing the loaders registered with taas.register", default=1),
    Option("--units", "K", "units", Count(1),
           "K >= 1: elements the data workers extract in all (default: one pass of the loader)"),
    Option("--cache-ram", "SIZE", "cache_ram", Size(),
           "prepared elements kept in RAM (512M, 4G; powers of 1024); the rest spills to disk", setting="cache_ram"),
    Option("--ahead", "E", "ahead", Count(2),
           "E >= 2, default 16: elements per rank that may wait before the data workers pause",
           default=16, setting="ahead"),
    Option("--timeout", "SECONDS", "timeout", Seconds(),
           "stop every rank after this long and name the ranks still running", setting="timeout"),
    Option("--restarts", "K", "restarts", Count(0, MAX_RESTARTS),
           f"0..{MAX_RESTARTS}, default 0: when the run fails, start every rank again up to K times in this cell",
           default=0, setting="restarts"),
    Option("--per-host", "G", "per_host", Count(1),
           "cluster mode: at most G ranks on any host"),
    Option("--place-timeout", "SECONDS", "place_timeout", Seconds(),
           "cluster mode: how long to wait for the cluster's GPUs (default 60)", default=60.0, setting="place_timeout"),
    Option("--output", "rank0|all", "output", Choice(*OUTPUT_MODES),
           "rank0 (default): only rank 0's output reaches the cell; all: every rank's, prefixed [rank k]",
           default="rank0", setting="output"),
    Option("--detach", "", "detach", Flag(),
           "run in the background: the cell returns at once with the live view; %taas wait binds rank 0's names",
           default=False),
    Option("--trials", "K", "trials", Count(1),
           "K >= 1: a hyperparameter search of K trials, each a run of --gpus ranks (taas.trial() in the cell)"),
    Option("--parallel", "P", "parallel", Count(1),
           "trials at a time (default: as many as the GPUs allow, one on a host without GPUs)"),
    Option("--objective", "NAME", "objective", Name(),
           "the metric rank 0 reports with taas.report that judges a trial: its last value (default loss)",
           default="loss"),
    Option("--maximize", "", "maximize", Flag(),
           "the search maximises the objective (default: minimises)", default=False),
    Option("--sampler", "tpe|random|grid", "sampler", Choice(*SAMPLERS),
           "Optuna's sampler (default tpe); grid: every combination of the cell's literal suggestions",
           default="tpe"),
    Option("--prune", "median|halving|none", "prune", Choice(*PRUNERS),
           "Optuna's pruner, fed by rank 0's reports of the objective (default median)", default="median"),
    Option("--study", "NAME", "study", Name(),
           "keep the study in <repository>/.taas/studies.db: rerunning the cell continues it"),
)
SEARCH_ONLY = ("--parallel", "--objective", "--maximize", "--sampler", "--prune", "--study")
_BY_FLAG = {option.flag: option for option in OPTIONS}
SETTINGS = {option.setting: option for option in OPTIONS if option.setting is not None}  # TaasMagics name -> option


def option(flag: str) -> Option:
    """The table's row for ``flag``."""
    return _BY_FLAG[flag]


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
    return RunSettings(configs=options.configs, **values)  # type: ignore[arg-type]  # each row holds its field's type


def setting_refusal(name: str, value: object) -> str | None:
    """What the session setting ``name`` accepts, when ``value`` is not among it; None when it is."""
    return SETTINGS[name].value.refusal(value)


def shown_defaults(session: Mapping[str, object]) -> list[tuple[str, object]]:
    """Each option's session default as ``%taas status`` shows it (``auto``: the host decides)."""
    shown = [(row.flag, session[row.setting]) for row in OPTIONS if row.setting is not None]
    return [(flag, "auto" if value == "" else value) for flag, value in shown]


def usage() -> str:
    words = [o.signature if o.required else f"[{o.signature}]" for o in OPTIONS]
    return "usage: #pragma taas " + " ".join(words)


def parse_options(args: str, configs: tuple[str, ...] = ()) -> PragmaOptions:
    """Parse the option part of a pragma (everything after ``#pragma taas``)."""
    tokens = args.split()
    values: dict[str, object] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name, eq, inline = token.partition("=")
        if name not in _BY_FLAG:
            if token.startswith("-"):
                raise PragmaError(f"unknown option {token!r}")
            raise PragmaError(f"unexpected token {token!r} (options start with --)")
        if name in values:
            raise PragmaError(f"duplicate option {name!r}")
        if isinstance(_BY_FLAG[name].value, Flag):
            if eq:
                _BY_FLAG[name].parse(inline)  # raises: a flag takes no value
            values[name] = True
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
        values[name] = _BY_FLAG[name].parse(raw)
    for option in OPTIONS:
        if option.required and option.flag not in values:
            raise PragmaError(f"{option.flag} {option.metavar} is required")
    _check_search(values)
    fields = {_BY_FLAG[flag].field: value for flag, value in values.items()}
    return PragmaOptions(configs=configs, **fields)  # type: ignore[arg-type]  # each parser returns its field's type


def _check_search(values: dict[str, object]) -> None:
    """The search's options mean something only in a search; a search is not detached (yet)."""
    if "--trials" not in values:
        alone = [flag for flag in SEARCH_ONLY if flag in values]
        if alone:
            raise PragmaError(f"{alone[0]} belongs to a search: add --trials K")
    elif "--detach" in values:
        raise PragmaError("--detach with --trials: a search runs in its cell (interrupt it to stop every trial)")


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
