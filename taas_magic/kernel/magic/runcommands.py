"""``%taas runs``, ``attach``, ``wait`` and ``stop``: the runs of this kernel, from any cell.

Runs in the kernel, on the cell's thread, whichever thread the run is on.

A detached run (``--detach``) goes on while the notebook is used; these find it by its id (or
a prefix; none: the newest running run, else the newest whose names were not taken,
kernel/runs/background.py) and:

- ``runs`` lists them: state, ranks, start time, the last line rank 0 printed;
- ``attach`` shows a run's live view in this cell: its widget where the page restores
  widgets (live by itself), else its log as this cell's output from the first entry, then
  live until the run ends (an interrupt leaves the run running and stops showing it);
- ``wait`` blocks until it ends, then binds rank 0's names and returns its value exactly as a
  foreground cell does, or raises its error (an interrupt stops the waiting, not the run);
- ``stop`` stops it with the stop ladder, and prints where its ranks were (the autopsy).
"""

from __future__ import annotations

from typing import Callable

from taas_magic.kernel.magic.status import kept_lines, runs_table
from taas_magic.kernel.runs import views
from taas_magic.kernel.runs.background import Runs, RunThread
from taas_magic.kernel.runs.foreground import LEAVE, POLL_SECONDS, consoling, serve_prompts, wait_blocking
from taas_magic.kernel.runs.rankset import RankSet
from taas_magic.output.runlog import OUT, SAY

Viewing = Callable[[RunThread], views.Viewing]  # how a view is chosen for a run in this cell
Take = Callable[[RunThread], object]  # bind a finished run's names in the notebook (magics.py)


def list_runs(runs: Runs, kept: RankSet | None = None) -> None:
    print(runs_table([run.summary() for run in runs.all()]))
    if kept is not None:
        print("\n".join(kept_lines(kept)))


def attach(runs: Runs, given: str | None, viewing: Viewing) -> None:
    run = runs.find(given, "%taas attach")
    shown = views.attach(run, viewing(run))
    if shown is not None:
        try:
            wait_blocking(run, shown, LEAVE)
        except KeyboardInterrupt:
            print(f"taas: stopped showing run {run.id}; it goes on (%taas attach {run.id} shows it again)")


def wait(runs: Runs, given: str | None, take: Take) -> object:
    run = runs.find(given, "%taas wait")
    try:
        with consoling(run) as console:  # a rank's pdb prompt, while this cell waits
            while not run.join(POLL_SECONDS):
                serve_prompts(run, None, console)
    except KeyboardInterrupt:
        print(f"taas: stopped waiting; run {run.id} goes on (%taas stop {run.id} stops it)")
        raise
    return take(run)


def stop(runs: Runs, given: str | None) -> None:
    run = runs.find(given, "%taas stop")
    if run.done:
        print(f"taas: run {run.id} already ended ({run.state})")
        return
    before = run.log.next_seq
    run.stop()
    while not run.join(POLL_SECONDS):
        pass
    _, entries = run.log.since(before - 1)
    said = "".join(entry.text if entry.kind == OUT else entry.text + "\n"
                   for entry in entries if entry.kind == SAY or (entry.kind == OUT and entry.stream == "stderr"))
    print(said.rstrip("\n") + "\n" if said.strip() else "", end="")
    print(f"taas: run {run.id} stopped; every rank of it is gone" + ("" if run.taken else
          f" (%taas wait {run.id} raises how it ended)"))
