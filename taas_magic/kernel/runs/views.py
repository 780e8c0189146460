"""Which view a run gets in a cell, and putting it there.

Runs in the kernel, on the cell's thread: it chooses the view and starts its pump
(output/liveview.py), whose own thread feeds it from then on, and starts a cell's run once its view
is in place (:func:`start_shown`).

Three views of one log (output/runlog.py), chosen per cell (output/frontend.py says whether
the page restores widgets):

- the live widget (output/widget.py), fed by its pump thread: in a foreground cell, in a
  detached one, and again by ``%taas attach``; the cell itself then shows only the ranks' own
  displays, which the widget cannot render;
- the cell's stream (output/cellstream.py), through the cell's budget: a foreground cell and
  ``%taas attach`` where the page has no widgets, exactly today's output;
- a text display updated in place (output/liveview.py's TextView): a detached run where the
  page has no widgets (the cell returned; its display is still addressed to it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from taas_magic.import_hooks import import_on_own_stack
from taas_magic.kernel.runs.background import BackgroundRun, RunThread
from taas_magic.kernel.supervision.prompts import Console
from taas_magic.output.budget import OutputBudget
from taas_magic.output.cellstream import CellStream
from taas_magic.output.frontend import cell_output, cell_publisher, mid_cell_note
from taas_magic.output.liveview import LivePump, TextView
from taas_magic.output.relay import TextOut, publisher


@dataclass(frozen=True)
class Viewing:
    """What choosing and placing a view takes: the shell, whether to use the widget, the cell's budget."""

    shell: Any
    widget: bool
    budget: OutputBudget


@dataclass(frozen=True)
class Started:
    """A run just started from a cell, and what the cell shows of it while it waits (None: nothing)."""

    run: RunThread
    shown: CellStream | None
    console: Console | None = None  # a foreground run's: this cell shows its ranks' pdb prompts (kernel/supervision/prompts.py)


def show_run(run: RunThread, viewing: Viewing) -> CellStream | None:
    """Put ``run``'s view in the cell that started it; what that cell itself shows while it waits."""
    if viewing.widget:
        _display(viewing.shell, live_widget(run))
        if run.detached:
            return None
        shown = _stream(run, viewing, displays_only=True)
        note = mid_cell_note(viewing.shell)  # an older ipykernel: a reloaded page waits for the cell's end
        if note is not None:
            shown.say(note)
        return shown
    if run.detached:
        run.views.append(LivePump(run.log, TextView(run.log, cell_publisher(viewing.shell)), f"taas-view-{run.id}",
                                  run.view_ended))
        return None
    return _stream(run, viewing)


def start_shown(run: BackgroundRun, viewing: Viewing) -> CellStream | None:
    """Start ``run`` from the cell, its view placed first: a cell on kept ranks sends them its frames now (and the
    board's displays go under the header: BackgroundRun.begin), then the view and what the log holds go out, then
    the run's thread starts (once up, it would hold the GIL a while, and the header would wait for it). A view
    that fails leaves the run going (``%taas attach``)."""
    run.begin()
    try:
        shown = show_run(run, viewing)
        if shown is not None:
            shown.show_new()
    finally:
        run.start()
    return shown


def attach(run: RunThread, viewing: Viewing) -> CellStream | None:
    """``%taas attach``: the run's widget again (it is live: nothing to wait for), or its log as this
    cell's stream from the first entry (the caller shows it until the run ends)."""
    if viewing.widget:
        _display(viewing.shell, live_widget(run))
        return None
    return _stream(run, viewing)


def live_widget(run: RunThread) -> Any:
    """The run's one widget (made, and its pump started, the first time)."""
    if run.widget is None:
        # its first import (anywidget, ipywidgets) on a stack of its own: import_hooks.py says why
        widget = import_on_own_stack("taas_magic.output.widget")
        run.widget = widget.LiveView(run.log)
        run.views.append(LivePump(run.log, run.widget, f"taas-widget-{run.id}", run.view_ended))
    return run.widget


def _stream(run: RunThread, viewing: Viewing, displays_only: bool = False) -> CellStream:
    direct = cell_output(viewing.shell)  # each entry sent at once (frontend.py says why), where the cell's output is ipykernel's
    if direct is not None:
        return CellStream(run.log, *direct, viewing.budget, displays_only)
    streams: dict[str, TextOut] = {"stdout": sys.stdout, "stderr": sys.stderr}
    return CellStream(run.log, streams, publisher(viewing.shell.display_pub), viewing.budget, displays_only)


def _display(shell: Any, widget: Any) -> None:
    from IPython.display import display

    display(widget)
