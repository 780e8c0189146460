"""A run on its own thread, and the runs of this kernel.

Runs in the kernel: :class:`RunThread` starts the run's own thread (``taas-run-ID``), where its work
runs; it is waited for, taken and stopped from the cell's thread, and :class:`Runs` is read there
and closed at the kernel's exit.

Every run, in the foreground or detached (``--detach``), is supervised on a thread of its own
(:class:`BackgroundRun`): the same supervisor, stop ladder, autopsy and release as ever
(kernel/runs/execution.py, kernel/runs/run.py), writing everything it shows into its log
(output/runlog.py). The kernel's main thread only shows the log and waits:

- a foreground cell waits for its run (kernel/runs/foreground.py), which lets the kernel answer a
  reloaded page's widgets meanwhile, and binds rank 0's names when it ends;
- a detached cell returns at once; the run's names are bound only when someone asks for
  them (``%taas wait``, ``taas.wait()``), never behind the person's back while other cells run.

How a run ends is kept until it is taken: its outcome (rank 0's results, still in their
files) or its error, raised in the cell that waits for it. Then the run lets go
(:meth:`RunThread.let_go`): what it captured and what rank 0 sent are the person's, so once its
names are bound (or its error raised, or it failed or was stopped: nothing will be bound) no
object of taas keeps its closure's packed tensors, its handoff, its results or its log's
entries in the kernel; a name the person deletes is freed at once. What stays is its summary
and its log's file on disk, for ``%taas runs`` and ``%taas status``. A stop (``%taas stop``, or an
interrupt of the cell that waits in the foreground) is the supervisor's interrupt: the
autopsy, then every rank stopped. An interrupt of the kernel never reaches this thread, so a
detached run goes on; shutting the kernel down stops every run (:meth:`Runs.close`, at exit),
and each rank's lifeline stops it should the kernel die without that.

:class:`Runs` holds this kernel's runs in the order they started, finds one by its id (or a
prefix of it), and says which run holds the host's GPUs. It keeps every run still running or
waiting to be taken, and the last ``KEEP_ENDED`` (100) that were taken; older ones are forgotten.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import threading
import time
import traceback
from typing import Any, Callable, TypeVar

from IPython.core.error import UsageError

from taas_magic.errors import RunInterrupted
from taas_magic.kernel.runs.execution import Execution, execute
from taas_magic.kernel.runs.run import Run, ending
from taas_magic.kernel.runs.summary import RunSummary
from taas_magic.kernel.supervision.prompts import PromptDesk
from taas_magic.kernel.supervision.supervisor import RunOutcome
from taas_magic.output.runlog import RunLog

STOP_WAIT_SECONDS = 60.0  # at exit: how long a run's stop ladder may take before the kernel leaves anyway
KEEP_ENDED = 100  # runs taken (or refused) that %taas runs still lists: each a summary and an empty log
RUNNING = "running"
RunThreadT = TypeVar("RunThreadT", bound="RunThread")


class RunThread:
    """Something a cell started that runs on a thread of its own and ends once: a run, or a search of
    runs (kernel/trials/searchrun.py). Subclasses say what the work is (:meth:`_work`) and how its outcome is
    bound in the notebook (:meth:`_bind`); the rest (stop, wait, take once) is here."""

    def __init__(self, log: RunLog, run_id: str, ranks: int, on_gpus: bool, detached: bool):
        self.log, self.id, self.ranks, self.on_gpus, self.detached = log, run_id, ranks, on_gpus, detached
        self.started = time.time()
        self.outcome: Any = None
        self.error: BaseException | None = None
        self.taken = False  # its names were bound (or its error raised) in a cell
        self.widget: Any = None  # its live widget, once a cell showed one (kernel/runs/views.py)
        self.views: list[Any] = []  # the pumps feeding its views
        self.prompts: PromptDesk | None = None  # its ranks' pdb prompts (a search has none: kernel/supervision/prompts.py)
        self._let_go = False  # let_go() was called: nothing of it will be bound
        self._stop = threading.Event()
        self._done = threading.Event()
        self._on_done: list[Callable[[], None]] = []
        self._thread = threading.Thread(target=self._main, name=f"taas-run-{self.id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _work(self) -> Any:
        raise NotImplementedError

    def _bind(self, namespace: dict) -> Any:
        raise NotImplementedError

    def _ended(self) -> None:
        """Once the work ended, before anyone waiting is woken (a run's log ends as its parts are released)."""

    def _let_go_of_parts(self) -> None:
        """Drop what the work holds for binding (see :meth:`let_go`)."""

    def let_go(self) -> None:
        """Nothing of this run will be bound (any more): forget its parts (the closure's packed tensors, its
        handoff, rank 0's results and their files) and, once every view of it has shown the run's last
        entry (:meth:`view_ended`), its log's entries in the kernel (its file stays; a widget keeps its own
        final snapshot). Once only (a search lets its ended trials go at every trial's end)."""
        if self._let_go:
            return
        light = self._carried_little()
        self._let_go_of_parts()
        self.outcome = None
        self._let_go = True
        self.view_ended()
        if not light:
            give_back_memory()

    def _carried_little(self) -> bool:
        """A cell on kept ranks whose closure and results were small: the heap is not trimmed for it
        (see :func:`give_back_memory`)."""
        return False

    def view_ended(self) -> None:
        """A view showed the run's last entry (its pump's thread), or the run let go: the log's entries in the
        kernel go once both happened for every view."""
        if self._let_go and all(view.finished for view in self.views):
            self.log.forget()

    def _main(self) -> None:
        try:
            self.outcome = self._work()
        except KeyboardInterrupt:  # a stop was asked: the autopsy is in the log, every rank stopped
            self.error = RunInterrupted()
        except BaseException as exc:  # noqa: BLE001 - kept and raised in the cell that waits for this run
            self.error = _without_locals(exc)
        finally:
            try:
                self._ended()
                if self.error is not None:  # failed or stopped: nothing will be bound (the error is raised when taken)
                    self._let_go_of_parts()
            finally:  # whatever releasing raised, whoever waits is woken
                self._done.set()
                for callback in list(self._on_done):
                    callback()

    @property
    def state(self) -> str:
        return ending(self.error) if self._done.is_set() else RUNNING

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def when_done(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` from the run's thread as it ends (at once if it has)."""
        self._on_done.append(callback)
        if self.done:
            callback()

    def stop(self) -> None:
        """Ask for the stop ladder (the supervisor sees it within a poll); :meth:`join` waits for it."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def take(self, namespace: dict) -> Any:
        """Once the run ended, in the kernel's main thread: raise its error, or bind rank 0's names in
        ``namespace`` and return its value, exactly as a foreground cell does; once only."""
        assert self.done, "take() after the run ended"
        if self.taken:
            raise UsageError(f"taas: run {self.id}'s results were already taken; a run binds its names once")
        self.taken = True
        try:
            if self.error is not None:
                raise self.error
            return self._bind(namespace)
        finally:
            self.let_go()

    def summary(self) -> RunSummary:
        return RunSummary(self.id, self.state, self.ranks, self.started, self.detached, self.taken, self.log.last_line)


class BackgroundRun(RunThread):
    """One run supervised on its own thread (see the module docstring)."""

    def __init__(self, run: Run, detached: bool):
        on_gpus = run.backend.devices.device == "cuda" and run.backend.loopback_only
        super().__init__(run.log, run.spec.run_id, run.settings.gpus, on_gpus, detached)
        self.run: Run | None = run  # None once it let go
        self.record = run.record  # the session's record of it (kernel/runs/summary.py): small, kept
        self.prompts = run.prompts
        self.outcome: RunOutcome | None = None
        self.execution: Execution | None = Execution(run, self._stop.is_set)  # wired now: see begin(); None once let go

    def _carried_little(self) -> bool:
        run, outcome = self.run, self.outcome
        if run is None or not run.on_kept:
            return False
        result = outcome.result if outcome is not None else None
        carried = len(run.packing.skeleton) + sum(blob.nbytes for blob in run.packing.blobs)
        if result is not None:
            carried += len(result.skeleton) + (result.data.size if result.data is not None else 0)
        return carried < TRIM_BYTES

    def begin(self) -> None:
        """On the cell's thread, before :meth:`start`, for a run without data workers (their line goes above the
        board, so those runs leave all of it to their thread): the live board's two displays go into the log now,
        under the header, so the cell shows the three at once instead of each as the run's thread writes it (each
        a wake-up of the cell's thread). The cell's frames go to its ranks from the run's thread only
        (kernel/supervision/attempts.py)."""
        run, execution = self.run, self.execution
        if run is None or execution is None or run.data is not None:
            return
        execution.board.start()

    def _work(self) -> RunOutcome:
        assert self.run is not None and self.execution is not None
        with self.run:
            return execute(self.execution)

    def _bind(self, namespace: dict) -> Any:
        assert self.outcome is not None and self.run is not None
        return self.run.bind_results(self.outcome.result, namespace)

    def _let_go_of_parts(self) -> None:
        run, self.run, self.execution = self.run, None, None
        if run is not None and self.outcome is not None and not self.taken:
            run.drop_results()  # rank 0's results files: never to be bound
        self.outcome = None


TRIM_BYTES = 1 << 20  # a kept cell's closure and results, together: below this its run does not trim the heap


def give_back_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``; a no-op elsewhere).

    Freed memory is not always given back: after a large block is freed, glibc raises its mmap
    threshold (up to 32 MB), so the next tensors of a few MB come from the heap, and what is freed
    there stays in the process. Measured (every tensor freed, cells 10 to 60 of a kernel, each
    capturing a new 4 MB tensor and binding one back): the kernel grew by 53 MB; trimmed as each
    run starts and lets go, by 29 MB (what the notebook frees between those moments stays until
    the next). It takes 0.3 to 1 ms (a kernel with torch: its heap is large), so it is skipped for a cell on
    kept ranks that carried less than :data:`TRIM_BYTES` both ways: such a cell is a few milliseconds in all,
    and what it freed is handed back with the next run that carries more."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def _without_locals(error: BaseException) -> BaseException:
    """``error`` with the locals of its traceback's frames (and its causes') cleared: they are this thread's
    frames, which hold the run (its closure, its results), and IPython keeps the last error it showed
    (``sys.last_value``). The lines of the traceback stay."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__cause__ or current.__context__
    return error


class Runs:
    """This kernel's runs, oldest first."""

    def __init__(self) -> None:
        self._runs: dict[str, RunThread] = {}
        atexit.register(self.close)

    def add(self, run: RunThreadT) -> RunThreadT:
        self._runs[run.id] = run
        self._forget_old()
        return run

    def _forget_old(self) -> None:
        """Keep the last KEEP_ENDED runs that were taken; running and untaken ones are always kept."""
        taken = [run_id for run_id, run in self._runs.items() if run.done and run.taken]
        for run_id in taken[:max(0, len(taken) - KEEP_ENDED)]:
            del self._runs[run_id]

    def all(self) -> list[RunThread]:
        return list(self._runs.values())

    def running(self) -> list[RunThread]:
        return [run for run in self._runs.values() if not run.done]

    def find(self, given: str | None, what: str) -> RunThread:
        """The run ``given`` names (its id or a prefix); with none, the newest running run, else the
        newest whose names were not taken. ``what`` names the command, for the error."""
        if given:
            found = [run for run in self._runs.values() if run.id.startswith(given)]
            if len(found) == 1:
                return found[0]
            known = ", ".join(self._runs) or "none yet"
            reason = "no run" if not found else "more than one run"
            raise UsageError(f"taas: {reason} of this kernel matches {given!r} (its runs: {known}); %taas runs lists them")
        newest = self.running() or [run for run in self._runs.values() if not run.taken]
        if not newest:
            raise UsageError(f"taas: {what}: no run of this kernel is running or waiting to be taken; %taas runs lists them")
        return newest[-1]

    def gpu_holder(self) -> RunThread | None:
        """The running run whose ranks hold this host's GPUs, if any."""
        return next((run for run in self.running() if run.on_gpus), None)

    def close(self) -> None:
        """The kernel is leaving: stop every run that still runs, and wait for their stop ladders."""
        running = self.running()
        for run in running:
            run.stop()
        deadline = time.monotonic() + STOP_WAIT_SECONDS
        for run in running:
            run.join(max(0.0, deadline - time.monotonic()))
