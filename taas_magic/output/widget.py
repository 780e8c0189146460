"""The run's live view as a widget: it survives a page reload because its state lives in the kernel.

Runs in the kernel: fed by its pump's thread (output/liveview.py), and answering a view's
``backlog`` in its comm handler, on the kernel's main thread.

Why anywidget (over ipywidgets' own controls): the view needs code in the page, to redraw
``\\r`` lines in place and to ask the kernel for the entries after the last one it has; with
ipywidgets alone that means building and shipping a JupyterLab extension, while anywidget's
model carries its module (liveview.js) in its state, so the one installed extension renders it
in JupyterLab, Notebook 7 and VS Code alike. It needs ipywidgets' manager in the page, which
restores every model from the kernel after a reload (the ``jupyter.widget.control`` comm):
that is what brings this view back.

:class:`LiveView` is the model: the run's header, state and error, the chart, the status
lines, and a snapshot of rank 0's screen as of log entry ``seq`` (refreshed at most every
``SNAPSHOT_SECONDS``). A view (liveview.js) draws the snapshot and sends ``{"backlog": seq}``;
:meth:`LiveView.backlog` answers with every entry after it that the kernel still keeps (and,
were some only on disk, which). :meth:`push` is the :class:`~taas_magic.output.liveview.View`
a :class:`~taas_magic.output.liveview.LivePump` feeds: the new entries go to every open view
as one message, with text only for the lines a view's screen can still show (:func:`shown_entries`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from taas_magic.output.liveview import KEEP_LINES, Screen, entry_text, error_pointer, feed_screen, status_lines
from taas_magic.output.runlog import END, Entry, RunLog

SNAPSHOT_SECONDS = 1.0


def shown_entries(entries: list[Entry], keep: int = KEEP_LINES) -> list[list]:
    """The entries as a view takes them, ``[seq, stream, text]``, every number kept; text only for
    the last ``keep`` lines (a flood's older lines would scroll off the view's screen at once, so
    they are not sent to the page: a million-line run costs the page what its last lines do)."""
    shown: list[list] = []
    lines = 0
    for entry in reversed(entries):
        stream, text = entry_text(entry)
        if lines > keep:
            text = ""
        lines += text.count("\n")
        shown.append([entry.seq, stream, text])
    shown.reverse()
    return shown


class LiveView(anywidget.AnyWidget):
    """One run's live view (see the module docstring)."""

    _esm = (Path(__file__).with_name("liveview.js")).read_text()
    run_id = traitlets.Unicode("").tag(sync=True)
    header = traitlets.Unicode("").tag(sync=True)
    state = traitlets.Unicode("running").tag(sync=True)
    error = traitlets.List(traitlets.Unicode()).tag(sync=True)
    chart = traitlets.Unicode("").tag(sync=True)
    status = traitlets.Dict().tag(sync=True)
    lines = traitlets.List(traitlets.Unicode()).tag(sync=True)
    partial = traitlets.Unicode("").tag(sync=True)
    seq = traitlets.Int(-1).tag(sync=True)
    log_path = traitlets.Unicode("").tag(sync=True)

    def __init__(self, log: RunLog, **kwargs: Any) -> None:
        super().__init__(run_id=log.run_id, header=log.header_text, log_path=log.path, **kwargs)
        self._log = log
        self._screen = Screen()
        self._snapshot_at = 0.0
        self.on_msg(self._on_message)

    # -- fed by the pump (its thread) -----------------------------------------------------------
    def push(self, entries: list[Entry]) -> None:
        ended = feed_screen(self._screen, entries)
        if ended is not None:
            self.error = list(error_pointer(ended, self.run_id))
            self.state = ended.text
        self._state_from_displays()
        self.send({"entries": shown_entries(entries)})
        if entries[-1].kind == END or time.monotonic() - self._snapshot_at >= SNAPSHOT_SECONDS:
            self._snapshot(entries[-1].seq)

    def ended(self) -> None:
        pass  # push() took the snapshot with the run's last entry

    def _state_from_displays(self) -> None:
        status, chart = status_lines(self._log.displays())
        if status != self.status:
            self.status = status
        if chart and chart != self.chart:
            self.chart = chart
        if self._log.header_text != self.header:
            self.header = self._log.header_text

    def _snapshot(self, seq: int) -> None:
        """The screen as of entry ``seq``: what a view made after a reload starts from."""
        self._snapshot_at = time.monotonic()
        with self.hold_sync():
            self.lines = list(self._screen.lines)
            self.partial = self._screen.partial
            self.seq = seq

    # -- asked by a view (the kernel's main thread) -----------------------------------------
    def _on_message(self, _widget: object, content: dict, _buffers: list) -> None:
        if isinstance(content, dict) and isinstance(content.get("backlog"), int):
            self.backlog(content["backlog"])

    def backlog(self, seq: int) -> None:
        """Every entry after ``seq`` the kernel keeps, to the views (those that have them ignore them)."""
        first, entries = self._log.since(seq)
        reply: dict = {"backlog": True, "entries": shown_entries(entries)}
        if first > seq + 1:
            reply["skipped"] = [seq + 1, first - 1]
        self.send(reply)
