"""A search (``--trials K``): K runs of one cell, side by side as the GPUs allow, asked and told through Optuna.

Runs in the kernel: started from the cell's thread, its loop on the search's own thread (a
``RunThread``), each trial's run on a thread of its own (a ``BackgroundRun``).

:class:`SearchRun` is started from the cell like a run (kernel/runs/background.py's ``RunThread``:
stopped, waited for and taken once the same way) and its thread is the search's loop:

1. while fewer than ``P`` trials run (the search's slots: the host's GPUs divided by
   ``--gpus``, ``--parallel`` on a host without GPUs, the cluster's GPUs) and fewer than K
   were asked: ask Optuna for a trial (``study.ask()``), plan its run (kernel/runs/runplan.py) on the
   slot it takes (a slice of the host's GPUs, or its own placement on the cluster) with its
   :class:`TrialLink` (search/link.py: its ranks' suggestions, its objective, its pruning),
   and start it on its own thread (a ``BackgroundRun``, everything a run has: closure, write
   rule, restarts, data workers, autopsy);
2. when a trial's run ends, tell Optuna how (the objective's last value; pruned; failed) and
   give its slot to the next trial at once. A trial that failed is recorded, its error kept,
   and the search goes on;
3. when something changed, at most every half second, and once at the end, the table and the
   chart (output/trialtable.py) into the search's log, which the cell shows; the best trial's last
   lines under the table.

Only the best trial's results are kept: when a better one ends, the previous best's rank-0
files are removed, and a trial that is not the best has its removed as it ends. Once every
trial ended, the cell binds the best trial's names (:meth:`SearchRun._bind`); the cell fails
only when every trial failed, with the first failure's error. A stop (an interrupt of the
cell) stops every running trial through its own stop ladder and tells Optuna they failed, so
a ``--study`` file keeps no trial marked running.

A plan that cannot be made (the closure cannot be sent, the cluster cannot place) is not a
trial's failure: the search stops there with that error.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from taas_magic.cell.cellcode import CellCode
from taas_magic.cell.pragma import RunSettings
from taas_magic.errors import SearchError, TrialPruned
from taas_magic.kernel.runs.background import BackgroundRun, RunThread
from taas_magic.kernel.runs.run import Run, ending, error_lines
from taas_magic.kernel.runs.runplan import PlanContext, plan
from taas_magic.kernel.runs.session import Session
from taas_magic.output.relay import Display
from taas_magic.output.runlog import OUT, RunLog
from taas_magic.output.trialtable import MOST_POINTS, TrialRow, search_display, trials_frame
from taas_magic.search.link import TrialLink
from taas_magic.search.space import every_point_asked
from taas_magic.search.study import COMPLETE, FAILED, PRUNED, RUNNING, STOPPED, tell

REDRAW_SECONDS = 0.5
TAIL_LINES = 8


@dataclass(frozen=True)
class SearchPlan:
    """What every trial's plan is made from, decided in the cell before the search starts."""

    settings: RunSettings
    code: CellCode
    closure: dict
    why: str | None
    context: Callable[[int], PlanContext]  # a slot -> the context whose backend places a trial there
    slots: int  # trials at a time
    on_gpus: bool  # the trials hold this host's GPUs
    grid: dict[str, list[Any]] | None = None  # --sampler grid: its grid (search/space.py)


@dataclass
class Trial:
    """One trial as the search holds it."""

    link: TrialLink
    slot: int
    run: BackgroundRun
    state: str = RUNNING
    value: float | None = None
    error: BaseException | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    seen: int = -1  # the last log entry read into ``tail``
    partial: str = ""
    ranks_gone: bool = False  # its slot is free (its run still releases the rest)
    slot_returned: bool = False

    def row(self, maximize: bool) -> TrialRow:
        link = self.link
        best = link.highest if maximize else link.lowest
        return TrialRow(link.number, dict(link.values), self.state, link.last, best, link.seconds, link.drawn(MOST_POINTS))


class SearchRun(RunThread):
    """A search of ``plan.settings.trials`` trials on its own thread (see the module docstring)."""

    def __init__(self, search: SearchPlan, study: Any, log: RunLog, session: Session):
        super().__init__(log, log.run_id, search.settings.gpus * search.slots, search.on_gpus, detached=False)
        self.plan, self.study, self.session = search, study, session
        self.trials: list[Trial] = []
        self._lock = threading.Lock()  # one Optuna call at a time, from the trials' threads and this one
        self._wake = threading.Event()
        self.view = SearchView(log, search.settings.objective, search.settings.maximize)

    # -- the loop (this search's thread) -----------------------------------------------------------
    def _work(self) -> Trial:
        settings = self.plan.settings
        assert settings.trials is not None  # a search's settings
        free = list(range(self.plan.slots))
        try:
            while not self._stop.is_set():
                self._wake.clear()  # before looking: a trial that ends from here on wakes the wait below
                free.extend(self._freed_slots())  # a slot freed goes to the next trial now, not after a wait
                self._finish_ended()
                while free and len(self.trials) < settings.trials and not self._stop.is_set() and not self._exhausted():
                    self._start_trial(free.pop(0))
                if not self.running_trials() and (len(self.trials) >= settings.trials or self._exhausted()):
                    break
                self._redraw()
                self._wake.wait(REDRAW_SECONDS)
        finally:
            self._stop_all()
            self._redraw(force=True)
        if self._stop.is_set():
            raise KeyboardInterrupt
        return self._verdict()

    def stop(self) -> None:
        super().stop()
        self._wake.set()

    def _let_go_of_parts(self) -> None:
        """The search ended (or was taken): no trial is planned again, so the captured closure goes, and every
        trial lets go of its parts (the best's were bound, the others' never will be)."""
        self.plan = dataclasses.replace(self.plan, closure={})
        for trial in self.trials:
            trial.run.let_go()

    def _ended(self) -> None:
        _show_metrics(self.session, self.best() or max(self.trials, key=lambda trial: trial.link.ended or 0.0, default=None))
        self.log.end(ending(self.error), error_lines(self.error))  # the search's log ends as a run's does

    def running_trials(self) -> list[Trial]:
        return [trial for trial in self.trials if trial.state == RUNNING]

    def _exhausted(self) -> bool:
        """A grid whose every point was asked for, by a trial running or ended (search/space.py)."""
        with self._lock:
            return self.plan.grid is not None and every_point_asked(self.study.get_trials(deepcopy=False), self.plan.grid)

    def _start_trial(self, slot: int) -> None:
        settings = self.plan.settings
        with self._lock:
            asked = self.study.ask()
        link = TrialLink(asked, settings.objective, self._lock, prunes=settings.prune != "none")
        try:
            run = plan(settings, self.plan.code, self.plan.closure, self.plan.why, self.plan.context(slot), link)
        except BaseException:
            tell(self.study, self._lock, link.trial, FAILED, None)
            raise  # the search cannot go on (the closure, the cluster): that is the cell's error
        trial = Trial(link, slot, BackgroundRun(run, detached=True))
        _quiet_breakpoints(run, link.trial.number, self.log)

        def ranks_gone() -> None:  # from the trial's thread, while its run releases the rest
            trial.ranks_gone = True
            self._wake.set()

        run.on_ranks_gone.append(ranks_gone)
        trial.run.when_done(self._wake.set)
        try:
            trial.run.start()  # the table shows it; its log's path is in taas.trials() (and in a failure's line)
        except BaseException:  # no thread for it: nothing of it runs, what its plan holds is released
            run.close()
            tell(self.study, self._lock, link.trial, FAILED, None)
            raise
        self.trials.append(trial)  # only a started trial is waited for

    def _freed_slots(self) -> list[int]:
        """The slots of the trials whose ranks are gone since the last look (their runs may still be releasing)."""
        freed = [trial for trial in self.trials if not trial.slot_returned and (trial.ranks_gone or trial.run.done)]
        for trial in freed:
            trial.slot_returned = True
        return [trial.slot for trial in freed]

    def _finish_ended(self) -> None:
        """Tell Optuna how each trial that ended since the last look ended."""
        for trial in self.running_trials():
            if trial.run.done:
                self._finish(trial)

    def _finish(self, trial: Trial) -> None:
        link, error = trial.link, trial.run.error
        link.ended = link.ended or link.started + link.seconds
        if error is None and link.last is None:
            error = SearchError(f"taas: trial {link.number} ended without reporting {link.objective!r} "
                                f"with taas.report (the objective, --objective)")
        state = _state_of(error)
        trial.state, trial.error = state, error
        trial.value = link.last if state == COMPLETE else None
        tell(self.study, self._lock, link.trial, state, trial.value)
        _keep_only(self.best(), self.trials)
        if state == FAILED:
            self.log.say(f"taas: trial {link.number} failed: {_first_line(error)} (its log: {trial.run.log.path})", "stderr")
        elif state == PRUNED:
            self.log.say(f"taas: trial {link.number} pruned at step {link.curve.last[0]:g}" if link.curve.count else
                         f"taas: trial {link.number} pruned")

    def _stop_all(self) -> None:
        """Every trial still running is stopped (its own stop ladder) and told to Optuna, each one
        whatever happened telling another (the first such error is raised after the last)."""
        running = self.running_trials()
        for trial in running:
            trial.run.stop()
        failed: BaseException | None = None
        for trial in running:
            trial.run.join()
            try:
                self._finish(trial)
            except Exception as exc:  # noqa: BLE001 - the other trials are still told; raised below
                failed = failed or exc
        if failed is not None:
            raise failed

    # -- the best, and what the cell shows ----------------------------------------------------------
    def best(self) -> Trial | None:
        return best_of(self.trials, self.plan.settings.maximize)

    def _verdict(self) -> Trial:
        return verdict(self.trials, self.best(), self.plan.settings.objective, self.log)

    def _bind(self, namespace: dict) -> Any:
        best: Trial = self.outcome
        return best.run.take(namespace)

    def _redraw(self, force: bool = False) -> None:
        running = self.running_trials()
        leader = self.best() or (running[-1] if running else None)  # the best so far, else the newest running
        self.view.draw(self.trials, leader, force)


class SearchView:
    """The search's two displays in its log: the table (with the leader's last lines) and the chart,
    each updated in place, when something changed since the last time, at most every REDRAW_SECONDS
    unless forced (output/trialtable.py draws them)."""

    def __init__(self, log: RunLog, objective: str, maximize: bool):
        self.log, self.objective, self.maximize = log, objective, maximize
        self._shown: set[str] = set()  # the display ids published once (the next are updates)
        self._drawn: object = None  # what the displays showed last, and when
        self._drawn_at = 0.0

    def draw(self, trials: list[Trial], leader: Trial | None, force: bool) -> None:
        lines = _tail(leader) if leader is not None else []
        seen = ([(trial.state, trial.link.curve.count) for trial in trials], lines)
        now = time.monotonic()
        if not trials or seen == self._drawn or (not force and now - self._drawn_at < REDRAW_SECONDS):
            return
        self._drawn, self._drawn_at = seen, now
        rows = [trial.row(self.maximize) for trial in trials]
        table, chart = search_display(rows, self.objective, leader.link.number if leader else None, lines)
        for name, data in (("table", table), ("chart", chart)):
            if data is not None:
                display_id = f"taas-search-{name}-{self.log.run_id}"
                self.log.publish(Display(data, {}, {"display_id": display_id}, display_id in self._shown))
                self._shown.add(display_id)


def verdict(trials: list[Trial], best: Trial | None, objective: str, log: RunLog) -> Trial:
    """The search's outcome, said in its log: the best trial, or the first trial's error when none completed."""
    counts = collections.Counter(trial.state for trial in trials)
    summary = ", ".join(f"{count} {state}" for state, count in counts.items())
    if best is None:
        failed = [trial.error for trial in trials if trial.error is not None]
        log.say(f"taas: no trial of {len(trials)} completed ({summary})", "stderr")
        raise failed[0] if failed else SearchError("taas: the search ran no trial")
    params = ", ".join(f"{name}={value!r}" for name, value in best.link.values.items())
    log.say(f"taas: best trial {best.link.number}: {objective} {best.value:.6g} · "
            f"{params or 'no params'} ({summary} of {len(trials)})")
    return best


def _state_of(error: BaseException | None) -> str:
    """How a trial ended, as the table says it: complete, pruned, stopped (an interrupt) or failed."""
    if isinstance(error, TrialPruned):
        return PRUNED
    if isinstance(error, KeyboardInterrupt):
        return STOPPED
    return FAILED if error is not None else COMPLETE


def _keep_only(best: Trial | None, trials: list[Trial]) -> None:
    """Drop the results of every trial that ended and is not the best (its rank-0 files, and what rank 0 sent,
    and, once there is a best, its reports for taas.metrics(): an ended trial never becomes the best later)."""
    for trial in trials:
        if trial is not best and trial.state != RUNNING and best is not None:
            trial.link.metrics = []
        if trial is not best and trial.state != RUNNING:
            trial.run.let_go()  # its results files, its closure's packed tensors: never to be bound


def _show_metrics(session: Session, trial: Trial | None) -> None:
    """After the search, the session's last run is the best trial (else the last to end): ``taas.metrics()``
    gives its rank-0 reports, ``%taas status`` and ``taas.load_checkpoint()`` read it."""
    if trial is not None:
        trial.run.record.metrics = trial.link.metrics
        session.last_run = trial.run.record


def best_of(trials: list[Trial], maximize: bool) -> Trial | None:
    """The completed trial with the best value (the first such, on a tie)."""
    done = [trial for trial in trials if trial.state == COMPLETE and trial.value is not None]
    if not done:
        return None
    pick = max if maximize else min
    return pick(done, key=lambda trial: trial.value if trial.value is not None else 0.0)


def trials_table(trials: list[Trial]) -> Any:
    """``taas.trials()``: number, params, value, state, seconds and log of each trial (output/trialtable.py's frame)."""
    return trials_frame([{"number": trial.link.number, "params": dict(trial.link.values), "value": trial.value,
                          "state": trial.state, "seconds": round(trial.link.seconds, 3), "log": trial.run.log.path}
                         for trial in trials])


def _tail(trial: Trial) -> list[str]:
    """The trial's last lines of rank 0's output (a ``\\r`` redraw keeps only its last state)."""
    _, entries = trial.run.log.since(trial.seen)
    for entry in entries:
        trial.seen = entry.seq
        if entry.kind != OUT:
            continue
        *whole, trial.partial = (trial.partial + entry.text).split("\n")
        trial.tail.extend(line.rsplit("\r", 1)[-1] for line in whole)
    shown = list(trial.tail) + ([trial.partial.rsplit("\r", 1)[-1]] if trial.partial.strip() else [])
    return shown[-TAIL_LINES:]


def _first_line(error: BaseException | None) -> str:
    if error is None:
        return ""
    render = getattr(error, "_render_traceback_", None)
    lines = list(render()) if render is not None else [f"{type(error).__name__}: {error}"]
    return next((line for line in lines if line.strip()), "")[:300]


def _quiet_breakpoints(run: Run, number: int, search_log: RunLog) -> None:
    """A trial's ranks never prompt (trials run side by side, and a search is for many runs): a breakpoint's
    one line goes into the trial's log and the search's, which the cell shows."""
    own = run.prompts.say
    run.prompts.unwatched = "a search's trials never prompt"

    def say(line: str, stream: str) -> None:
        own(line, stream)
        search_log.say(line.replace("taas: rank", f"taas: trial {number}, rank", 1), stream)

    run.prompts.say = say
