"""The option table: every pragma option once, with its value's grammar, default, help and session setting.

Runs wherever it is imported: in the kernel, on the cell's thread (the parser, the settings,
``%taas help``), and in the docs' build (docs/hooks/reference.py).

:data:`OPTIONS` is the one place an option is defined. The pragma's parser (cell/pragma.py),
the usage line, ``%taas help`` (kernel/magic/status.py), the session's ``%config`` traits
(kernel/magic/settings.py) and the docs' option reference (docs/reference/options.md, made
by docs/hooks/reference.py at build time, which fails on an option the table lacks) are all
made from it.

Each value type parses one token and raises :class:`PragmaError` naming the flag and the
token; each also says what a session setting of it accepts (``refusal``). Pure: nothing
here is launched or read from the host.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Union

from IPython.core.error import UsageError

OUTPUT_MODES = ("rank0", "all")
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "halving", "none")
DEVICES = ("auto", "cpu", "cuda")
AUTO = "auto"  # --gpus auto: one rank per GPU of this host (2 CPU ranks where there is none)
MAX_CPUS = 8
MAX_RESTARTS = 100
PROFILE_STEPS = 3  # --profile alone: this many steps after the first
MAX_PROFILE_STEPS = 1000
HANG_SECONDS = 30.0  # --hang's default: a rank this long in one collective, and the cell says so

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
    """A positive, finite number of seconds (or 0 too, where ``zero`` says what 0 means)."""

    def __init__(self, zero: str = ""):
        self.zero = zero

    def parse(self, flag: str, token: str) -> float:
        try:
            value = float(token)
        except ValueError:
            raise PragmaError(f"{flag} needs a number of seconds, got {token!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not self.zero):
            raise PragmaError(f"{flag} must be {self._accepted()}, got {token!r}")
        return value

    def refusal(self, value: object) -> str | None:
        if value is None or (isinstance(value, (int, float)) and math.isfinite(value)
                             and (value > 0 or (value == 0 and bool(self.zero)))):
            return None
        return self._accepted()

    def _accepted(self) -> str:
        return "a positive number of seconds" + (f", or 0 ({self.zero})" if self.zero else "")

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


class OptionalCount(Count):
    """A whole number that may be left out: the flag alone means ``bare`` (``--profile`` is ``--profile 3``)."""

    def __init__(self, least: int, most: int | None, bare: int):
        super().__init__(least, most)
        self.bare = bare


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


class Folders:
    """Folders, comma-separated (``ckpt,outputs/zero``): kept as written, resolved against the repository by the plan."""

    def parse(self, flag: str, token: str) -> tuple[str, ...]:
        folders = tuple(folder for folder in token.split(",") if folder)
        if not folders:
            raise PragmaError(f"{flag} needs a folder, or folders separated by commas, got {token!r}")
        return folders

    def refusal(self, value: object) -> str | None:
        return None if isinstance(value, tuple) and all(isinstance(folder, str) for folder in value) else "folders"

    def from_setting(self, value: object) -> object:
        return value


def parse_size(token: str) -> int | None:
    """``4G``, ``512MiB``, ``1.5g``, ``1000`` -> bytes (K/M/G/T are powers of 1024); None if malformed."""
    match = _SIZE.match(token.strip())
    if match is None:
        return None
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


Value = Union[Count, OptionalCount, Seconds, Size, Choice, Flag, Name, Folders]


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
        """``--gpus N|auto``; a flag alone, ``--detach``; a value that may be left out, ``--profile [N]``."""
        if isinstance(self.value, OptionalCount):
            return f"{self.flag} [{self.metavar}]"
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
    Option("--hang", "SECONDS", "hang", Seconds(zero="never"),
           "default 30: when a rank has waited this long in one collective, the cell says where every rank is "
           "(again at most once a minute; nothing is stopped); 0: never", default=HANG_SECONDS, setting="hang"),
    Option("--restarts", "K", "restarts", Count(0, MAX_RESTARTS),
           f"0..{MAX_RESTARTS}, default 0: when the run fails, start every rank again up to K times in this cell",
           default=0, setting="restarts"),
    Option("--per-host", "G", "per_host", Count(1),
           "cluster mode: at most G ranks on any host"),
    Option("--place-timeout", "SECONDS", "place_timeout", Seconds(),
           "cluster mode: how long to wait for the cluster's GPUs (default 60)", default=60.0, setting="place_timeout"),
    Option("--shared", "DIR[,DIR]", "shared", Folders(),
           "folders of the repository every rank writes in place, for a saver taas does not recognise "
           "(DCP, accelerate, the HF Trainer and Lightning are recognised): each rank's own files land there",
           default=()),
    Option("--output", "rank0|all", "output", Choice(*OUTPUT_MODES),
           "rank0 (default): only rank 0's output reaches the cell; all: every rank's, prefixed [rank k]",
           default="rank0", setting="output"),
    Option("--keep", "", "keep", Flag(),
           "keep the ranks after the cell, with their globals and process group: the next --keep cell of the same "
           "shape runs in them (%taas release ends them)", default=False, setting="keep"),
    Option("--profile", "N", "profile", OptionalCount(1, MAX_PROFILE_STEPS, PROFILE_STEPS),
           f"profile every rank for N steps after the first (default {PROFILE_STEPS}; steps as optimizer.step or "
           "taas.report mark them; a cell with fewer, whole): one merged Perfetto trace in the notebook's folder, "
           "and each rank's time working, communicating and waiting in the cell", default=0),
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
BY_FLAG = {option.flag: option for option in OPTIONS}
SETTINGS = {option.setting: option for option in OPTIONS if option.setting is not None}  # TaasMagics name -> option


def option(flag: str) -> Option:
    """The table's row for ``flag``."""
    return BY_FLAG[flag]


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
