"""The ``%taas`` line commands, as one table: :data:`COMMANDS`.

Runs in the kernel, on the cell's thread: a ``%taas`` line, or ``taas.wait`` / ``trials`` /
``study`` called in a cell (kernel/magic/fromcode.py); the docs' build reads the table too.

Each row (:class:`LineCommand`) is one way to write a command: its words, its argument if it
takes one, what it does, and the function that does it. Everything about the commands is read
from the rows, never written again:

- :func:`find` picks the row a ``%taas`` line names (an empty line is ``help``): its words
  first, then its argument (none, one word, or the rest of the line), the row with the most
  words winning (``cluster WORD X`` is an engine's row, not ``cluster ADDRESS``); a line no row
  takes raises IPython's ``UsageError``, the one line the cell shows;
- :data:`HELP` is ``%taas help`` (kernel/magic/status.py's text around the rows' usage and help);
- docs/hooks/reference.py makes reference/commands.md's table from the rows, and fails the docs
  build on a page naming a ``%taas WORD`` no row has;
- ``taas.wait()``, ``taas.trials()`` and ``taas.study()`` (kernel/magic/fromcode.py) call the
  handlers :func:`wait`, :func:`trials` and :func:`study` with their typed arguments.

A handler is called as ``handler(session, settings)``, or ``handler(session, settings, argument)``
when the line gives the argument; its value is the line's (``None``: it printed what it did).
The handlers here only adapt that call to the functions that do the work (linecommands.py,
runcommands.py, debug.py), which take only what they use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from IPython.core.error import UsageError

from taas_magic.errors import LaunchError
from taas_magic.export import command as exporting
from taas_magic.kernel.magic import linecommands, runcommands
from taas_magic.kernel.magic.debug import taas_debug
from taas_magic.kernel.magic.linecommands import MagicSettings
from taas_magic.kernel.magic.status import help_text
from taas_magic.kernel.runs.session import Session
from taas_magic.launch import engines

Handler = Callable[..., object]  # (session, settings[, argument]) -> the line's value


@dataclass(frozen=True)
class LineCommand:
    """``%taas WORDS [ARGUMENT]``: one row of :data:`COMMANDS`."""

    words: tuple[str, ...]  # the command: ("config", "repo")
    help: str  # what it does: its row in %taas help and in the docs' reference
    handler: Handler
    argument: str = ""  # its argument as help names it ("RUN", "off|auto|N"); "": it takes none
    optional: bool = False  # the argument may be left out (help shows "[RUN]"); the handler then gets none
    rest: bool = False  # the argument is the rest of the line, spaces and all; else one word

    @property
    def usage(self) -> str:
        """As help and the docs write it: ``%taas attach [RUN]``."""
        shown = f"[{self.argument}]" if self.optional else self.argument
        return " ".join(("%taas", *self.words) + ((shown,) if shown else ()))

    def arguments(self, line: str) -> tuple[str, ...] | None:
        """What ``line`` (stripped, not empty) gives this row's handler, or None: not this row's line."""
        split = line.split(maxsplit=len(self.words))
        if tuple(split[:len(self.words)]) != self.words:
            return None
        given = tuple(split[len(self.words):])  # () or (the rest of the line,)
        if not given:
            return () if self.optional or not self.argument else None
        return given if self.argument and (self.rest or len(given[0].split()) == 1) else None


# ---------------------------------------------------------------- the handlers


def show_help(session: Session, settings: MagicSettings) -> None:
    print(HELP)


def repository(session: Session, settings: MagicSettings, path: str) -> None:
    linecommands.set_repository(session, path)


def isolation(session: Session, settings: MagicSettings, mode: str) -> None:
    linecommands.set_isolation(session, mode)


def cluster(session: Session, settings: MagicSettings, given: str = "") -> None:
    linecommands.cluster(session, given)


def cluster_engine(word: str, session: Session, settings: MagicSettings, options: str = "") -> None:
    """``%taas cluster WORD [OPTIONS]``: the engine launch/engines.py names ``word``, given the options."""
    linecommands.cluster(session, options, word)


def runs(session: Session, settings: MagicSettings) -> None:
    runcommands.list_runs(session.runs, session.kept)


def release(session: Session, settings: MagicSettings) -> None:
    try:
        print(session.release_kept())
    except LaunchError as exc:
        raise UsageError(str(exc)) from None


def heal(session: Session, settings: MagicSettings, text: str) -> None:
    linecommands.heal(session, text)


def attach(session: Session, settings: MagicSettings, run: str | None = None) -> None:
    runcommands.attach(session.runs, run, settings.viewing)


def wait(session: Session, settings: MagicSettings, run: str | None = None) -> object:
    """``%taas wait [RUN]``, ``taas.wait(run)``: the run's value once it ends, its names bound."""
    return runcommands.wait(session.runs, run, settings.take)


def stop(session: Session, settings: MagicSettings, run: str | None = None) -> None:
    runcommands.stop(session.runs, run)


def export(session: Session, settings: MagicSettings, argument: str) -> None:
    from IPython import get_ipython

    exporting.export(get_ipython(), settings.defaults, argument)


def debug(session: Session, settings: MagicSettings, run: str | None = None) -> None:
    taas_debug(session.runs, run)


def trials(session: Session, settings: MagicSettings) -> object:
    """``%taas trials``, ``taas.trials()``."""
    return linecommands.trials(session)


def study(session: Session, settings: MagicSettings) -> object:
    """``%taas study``, ``taas.study()``."""
    return linecommands.study(session)


# ---------------------------------------------------------------- the table

COMMANDS = (
    LineCommand(("status",), "the last run, the devices seen, the defaults, the write rule", linecommands.status),
    LineCommand(("config", "repo"), "set the repository (default: $TAAS_REPO, the git work tree, the cwd)",
                repository, "PATH", rest=True),
    LineCommand(("config", "isolation"), "how other ranks' writes are diverted (auto: overlay where possible)",
                isolation, "auto|overlay|python", rest=True),
    LineCommand(("cluster",), engines.ADDRESSES.help, cluster, engines.ADDRESSES.argument, rest=True),
    *(LineCommand(("cluster", word), engine.help, functools.partial(cluster_engine, word), engine.argument,
                  optional=True, rest=True) for word, engine in engines.CLUSTER_WORDS.items()),
    LineCommand(("cluster",), "what is attached: its nodes, GPUs, time left; off releases it", cluster),
    LineCommand(("warm",), "warm spare ranks (torch imported) for the next cell; auto: as many as the last --gpus",
                linecommands.set_warm, "off|auto|N"),
    LineCommand(("runs",), "this kernel's runs: state, ranks, start time, last line", runs),
    LineCommand(("release",), "end the kept ranks (--keep): their processes, globals, memory and GPUs", release),
    LineCommand(("heal",), "copy kept rank K's names into the kept ranks that lack them (a rank that replaced a dead "
                "one); NAMEs: only those", heal, "--from K [NAME ...]", rest=True),
    LineCommand(("attach",), "show a run's live view here: what it showed so far, then live until it ends",
                attach, "RUN", optional=True),
    LineCommand(("wait",), "wait for a (detached) run, then bind rank 0's names and return its value",
                wait, "RUN", optional=True),
    LineCommand(("stop",), "stop a run: every rank, with the autopsy of where they were", stop, "RUN", optional=True),
    LineCommand(("debug",), "the failing rank's traceback with each frame's locals (%debug too; %pdb on: a live prompt)",
                debug, "RUN", optional=True),
    LineCommand(("trials",), "the last search's trials (a pandas DataFrame when pandas is installed); taas.trials()",
                trials),
    LineCommand(("study",), "the last search's Optuna study; taas.study()", study),
    LineCommand(("export",), "write the last taas cell (or In[N]) as a job: PATH for python or torchrun, its .sbatch "
                "and _ray.py; taas.load_job(PATH) brings rank 0's names back", export, "PATH [In[N]]", rest=True),
    LineCommand(("help",), "this text", show_help),
)

HELP = help_text([(command.usage, command.help) for command in COMMANDS])

_MOST_WORDS_FIRST = sorted(COMMANDS, key=lambda command: -len(command.words))  # stable: the table's order among equals


def find(line: str) -> tuple[LineCommand, tuple[str, ...]]:
    """The row ``line`` names and the arguments it gives (an empty line: ``help``).

    Raises:
        UsageError: no row takes the line.
    """
    command = line.strip() or "help"
    for row in _MOST_WORDS_FIRST:
        arguments = row.arguments(command)
        if arguments is not None:
            return row, arguments
    raise UsageError(f"taas: unknown %taas command {command!r}; try %taas help or %taas status")


def run(line: str, session: Session, settings: MagicSettings) -> object:
    """One ``%taas`` line: its row's handler called with the line's argument; ``wait`` returns the run's value."""
    row, arguments = find(line)
    return row.handler(session, settings, *arguments)
