"""The errors a taas cell can end with. Each renders itself as the cell's error.

Runs wherever it is imported: in the kernel, where the cell stage, the kernel's rooms, launch/ and
the search raise these and IPython renders them on the cell's thread, and in a Ray host agent or
Slurm task, whose local processes may raise :class:`LaunchError` (launch/local/processes.py).

::

    Exception
    ├── PragmaError (IPython UsageError)   malformed head; one line, nothing launched   [cell/options.py]
    ├── AuthenticationError (ConnectionError)  a peer without the key                   [wire.py]
    └── TaasError                          one line, no kernel-side traceback
        ├── ClosureError                   a used notebook name cannot be pickled           [closure.py]
        ├── DataPlanError                  the registered loaders cannot serve the run as asked [feed/plan.py]
        ├── ClusterError                   %taas cluster cannot attach (Ray missing, unreachable) [launch/ray/attachment.py]
        ├── LaunchError                    the ranks cannot be started (too few GPUs, ...)  [rankenv.py, launch/]
        ├── SearchError                    a search cannot start (no Optuna, a grid with no literal values) [search/]
        ├── TrialPruned                    the search's pruner stopped this trial early  [kernel/trials/searchrun.py]
        └── RunError                       the ranks started, the run failed                [supervisor.py, launch/]
            ├── RankFailed                 a rank raised, exited non-zero or was killed
            ├── WorkerFailed               a data worker raised preparing an element, or died
            └── RunTimeout                 --timeout passed; names the ranks still running

    KeyboardInterrupt
    └── RunInterrupted                     the person interrupted a run; shown as one          [magics.py]
                                           "KeyboardInterrupt" line below the autopsy

IPython shows an exception through its ``_render_traceback_`` when it has one (as
ipyparallel's RemoteError does): the lines are the rank's traceback, already pointing
at the cell's own line numbers, not the kernel's frames that supervised it (IPython's hook:
private API, see taas_magic/private.py).
Every class defines ``__reduce__`` so it survives pickling. A run's error is built whole:
what went wrong (a :class:`Failure`), what the failing process printed last and the notes
after it (why it was not restarted, where the ranks were) are constructor arguments, and
:meth:`RunError.with_output` makes a new error with them rather than changing the one the
supervisor first saw.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from taas_magic.peers import Peer

if TYPE_CHECKING:
    from taas_magic.protocol import WorkerFailure


class TaasError(Exception):
    """Base of taas's own errors; shown as one message, without the kernel's traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class ClosureError(TaasError):
    """A notebook name the cell uses cannot be sent to the ranks."""

    def __init__(self, name: str, type_name: str, reason: str):
        super().__init__(
            f"taas: cannot send `{name}` ({type_name}) to the ranks: {reason}. "
            f"Create it inside the cell, or make it picklable."
        )
        self.name, self.type_name, self.reason = name, type_name, reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.type_name, self.reason))


class DataPlanError(TaasError):
    """The registered loaders cannot serve this run as asked (no ``len()`` and no ``--units``,
    fewer elements than ranks); nothing was launched."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args)


class ClusterError(TaasError):
    """``%taas cluster`` (or ``$TAAS_CLUSTER``) cannot attach: Ray is not installed, or no
    cluster answers at the address; the kernel keeps the mode it had."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args)


class LaunchError(TaasError):
    """The ranks could not be started; nothing is left running."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args)


class SearchError(TaasError):
    """A search (``--trials``) cannot start or go on: nothing of it is left running."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args)


class TrialPruned(TaasError):
    """The search's pruner stopped this trial early (a trial's ending, not a failure of the search)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args)


class RunError(TaasError):
    """The ranks started but the run did not succeed; every rank has been stopped."""

    last_lines: tuple[str, ...] = ()  # the failing process's last lines of output, when it printed any
    notes: tuple[str, ...] = ()  # shown after the error: why it was not restarted, where the ranks were

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}", *self.notes]

    def with_output(self, last_lines: tuple[str, ...], notes: tuple[str, ...]) -> "RunError":
        """This failure as the cell shows it, a new error: the failing process's last lines of
        output, and ``notes`` after its own. (A run error without a failing process keeps only its own.)"""
        return self


def describe_exit(code: int | None) -> str:
    """A person's words for a process exit code (negative means killed by a signal)."""
    if code is None:
        return "was still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"


@dataclass(frozen=True)
class Failure:
    """What went wrong in a failed process: in words (``raised ValueError: x``, ``was killed by
    SIGKILL without reporting an error``), its traceback (the cell's line numbers; empty when
    it sent none), and a Python exception's signature: (type, innermost notebook file, line),
    which kernel/supervision/restarts.py compares between attempts."""

    summary: str
    traceback_text: str = ""
    signature: tuple[str, str, int] | None = None
    frames: tuple = ()  # (place, line, function, {local: repr}) per frame from the cell's down: %debug (kernel/magic/debug.py)


class PeerFailed(RunError):
    """The first process of a run to fail, a rank or a data worker, built whole: which process
    (``peer``), on which host, what went wrong there (a :class:`Failure`: what happened, its
    traceback with cell line numbers, its signature), its last lines of output, and the notes
    shown below it.

    ``PeerFailed(peer, ...)`` is a :class:`RankFailed` for a rank and a :class:`WorkerFailed`
    for a data worker: the names the cell shows and the README promises, which a person may
    catch; the behaviour is this class's alone.
    """

    def __new__(cls, peer: Peer, *args: Any, **kwargs: Any) -> "PeerFailed":
        if cls is PeerFailed:
            cls = RankFailed if peer.is_rank else WorkerFailed
        return super().__new__(cls)

    def __init__(self, peer: Peer, host: str, what: Failure, last_lines: tuple[str, ...] = (),
                 notes: tuple[str, ...] = (), stopped: bool = True):
        """``stopped``: every rank was stopped; False: kept ranks, each of which ended its cell and lives on."""
        super().__init__(f"{self._who(peer)} on {host} {what.summary}")
        self.peer, self.host, self.what = peer, host, what
        self.last_lines, self.notes, self.stopped = tuple(last_lines), tuple(notes), stopped

    @property
    def summary(self) -> str:
        return self.what.summary

    @property
    def traceback_text(self) -> str:
        return self.what.traceback_text

    @property
    def signature(self) -> tuple[str, str, int] | None:
        return self.what.signature

    @staticmethod
    def _who(peer: Peer) -> str:
        return f"rank {peer.index}" if peer.is_rank else f"data worker {peer.index}"

    def __reduce__(self) -> tuple[Any, ...]:
        return (PeerFailed, (self.peer, self.host, self.what, self.last_lines, self.notes, self.stopped))

    def with_output(self, last_lines: tuple[str, ...], notes: tuple[str, ...]) -> "PeerFailed":
        return PeerFailed(self.peer, self.host, self.what, last_lines, (*self.notes, *notes), self.stopped)

    def on_kept_ranks(self) -> "PeerFailed":
        """This failure where no rank was stopped: every kept rank ended its cell (kernel/supervision/keptcell.py)."""
        return PeerFailed(self.peer, self.host, self.what, self.last_lines, self.notes, stopped=False)

    @classmethod
    def from_worker_report(cls, peer: Peer, host: str, loader: str, report: WorkerFailure) -> "PeerFailed":
        """From a worker's ``WorkerFailure`` frame: frames get the notebook's source lines here,
        where IPython's cells are in ``linecache``; taas's own frames are left out."""
        import linecache
        import os

        package = os.path.dirname(os.path.abspath(__file__)) + os.sep
        lines = ["Traceback (most recent call last):\n"]
        for filename, lineno, name, line in report.frames:
            if os.path.abspath(filename).startswith(package):
                continue
            lines.append(f'  File "{filename}", line {lineno}, in {name}\n')
            line = line or (linecache.getline(filename, lineno) if lineno is not None else "")
            if line and line.strip():
                lines.append(f"    {line.strip()}\n")
        exception = report.exception.strip()
        raised = exception.splitlines()[-1] if exception else "an error"
        summary = f"raised {raised} while preparing {report.element} of {loader}"
        return PeerFailed(peer, host, Failure(summary, "".join(lines) + report.exception))

    def _render_traceback_(self) -> list[str]:
        """The cell's error lines: what happened and the notes, the traceback, the last lines of output."""
        who = self._who(self.peer)
        stopped = "every rank was stopped" if self.peer.is_rank else "every rank and worker was stopped"
        stopped = stopped if self.stopped else "every rank ended its cell"
        lines = [f"taas: {who} on {self.host} {self.summary}; {stopped}.", *self.notes]
        if self.traceback_text:
            lines.append(f"--- traceback of {who} ---")
            lines.extend(self.traceback_text.rstrip("\n").splitlines())
        if self.last_lines:
            lines.append(f"--- last {len(self.last_lines)} lines of output of {who} ---")
            lines.extend(self.last_lines)
        return lines


class RankFailed(PeerFailed):
    """The first rank to fail (``PeerFailed`` of a rank)."""

    @property
    def rank(self) -> int:
        return self.peer.index


class WorkerFailed(PeerFailed):
    """The first data worker to fail (``PeerFailed`` of a data worker): the element it was preparing."""

    @property
    def worker(self) -> int:
        return self.peer.index


class RunTimeout(RunError):
    """``--timeout`` passed before every rank finished."""

    def __init__(self, timeout: float, running: tuple[int, ...], notes: tuple[str, ...] = (), stopped: bool = True):
        """``stopped``: every rank was stopped; False: kept ranks, interrupted, each ended its cell and lives on."""
        ranks = ", ".join(str(rank) for rank in running) or "none"
        ending = "Every rank was stopped." if stopped else "Every rank was interrupted and ended its cell."
        super().__init__(f"taas: the run passed --timeout {timeout:g}s; ranks still running: {ranks}. {ending}")
        self.timeout, self.running, self.stopped = timeout, tuple(running), stopped
        self.notes = tuple(notes)  # where each rank was (the hang autopsy), then why it was not restarted

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.timeout, self.running, self.notes, self.stopped))

    def with_output(self, last_lines: tuple[str, ...], notes: tuple[str, ...]) -> "RunTimeout":
        return RunTimeout(self.timeout, self.running, (*self.notes, *notes), self.stopped)  # no process failed: no last lines

    def on_kept_ranks(self) -> "RunTimeout":
        """This timeout where no rank was stopped: the kept ranks were interrupted (kernel/supervision/keptcell.py)."""
        return RunTimeout(self.timeout, self.running, self.notes, stopped=False)


class RunInterrupted(KeyboardInterrupt):
    """The person interrupted the kernel while a run was supervised; every rank was stopped.

    The cell already shows the hang autopsy (where each rank was) above it: the kernel's
    own frames (the magic, the supervisor, the selector) say nothing the person can use,
    so it renders as the single line ``KeyboardInterrupt``, and is named so in the error
    message Jupyter receives (``ename``), like the interrupt the person sent.
    """

    def _render_traceback_(self) -> list[str]:
        return ["KeyboardInterrupt"]

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), self.args)


RunInterrupted.__name__ = "KeyboardInterrupt"  # ename: the person's own interrupt, not a taas type
