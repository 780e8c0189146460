"""A run's live view kept up to date from its log, on a thread of its own.

Runs in the kernel: each :class:`LivePump` on a helper thread of its own, started from the cell's
thread.

A view of a run that is not the cell's own stream (output/cellstream.py) is fed here: the
live widget (output/widget.py) in front ends that restore widgets, and, for a detached run
elsewhere, a text display updated in place (:class:`TextView`). :class:`LivePump` reads the
run log (output/runlog.py) on its own thread and hands each view the new entries in order,
at most every ``PUMP_SECONDS``, and a last time after the run's final entry: neither the run
(which only appends) nor the kernel's main thread (free for the person's next cell) waits
for a front end.

:class:`Screen` is rank 0's text as a terminal shows it: ``\\n`` ends a line, ``\\r``
starts it again (a progress bar redrawn in place), the last ``KEEP_LINES`` kept. The widget's
JavaScript (liveview.js) keeps the same screen from the same entries.
"""

from __future__ import annotations

import collections
import re
import threading
import time
from typing import Callable, Protocol

from taas_magic.output.cellstream import TAAS_DISPLAY_PREFIX
from taas_magic.output.relay import Display
from taas_magic.output.runlog import DISPLAY, END, OUT, SAY, Entry, RunLog

PUMP_SECONDS = 0.05  # at most 20 updates a second to a front end
KEEP_LINES = 400
TEXT_LINES = 20  # lines of rank 0's output a text view shows
_BREAKS = re.compile(r"(\r\n|\n|\r)")


class Screen:
    """Rank 0's recent text as a terminal shows it (see the module docstring)."""

    def __init__(self, keep: int = KEEP_LINES):
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.partial = ""
        self._carriage = False

    def feed(self, text: str) -> None:
        for piece in _BREAKS.split(text):
            if piece in ("\n", "\r\n"):
                self.lines.append(self.partial)
                self.partial, self._carriage = "", False
            elif piece == "\r":
                self._carriage = True
            elif piece:
                self.partial = piece if self._carriage else self.partial + piece
                self._carriage = False

    def shown(self, last: int | None = None) -> list[str]:
        lines = list(self.lines) + ([self.partial] if self.partial else [])
        return lines if last is None else lines[-last:]


def entry_text(entry: Entry) -> tuple[str, str]:
    """What an entry adds to the screen, as (stream, text); ("none", "") for what a view shows elsewhere
    (the chart and the status lines are state, rank 0's chart points only the log keeps)."""
    if entry.kind == OUT:
        return entry.stream, entry.text
    if entry.kind == SAY:
        return "say", entry.text + "\n"  # taas's own line (a restart, where the ranks were): on the screen too
    if entry.kind == DISPLAY and isinstance(entry.message, Display):
        if not (entry.display_id or "").startswith(TAAS_DISPLAY_PREFIX):  # a rank's own display, in text
            return "stdout", f"[display] {entry.message.data.get('text/plain', ', '.join(entry.message.data))}\n"
    return "none", ""


def feed_screen(screen: Screen, entries: list[Entry]) -> Entry | None:
    """Feed what ``entries`` add to a view's screen; the run's last entry, if it is among them."""
    ended = None
    for entry in entries:
        stream, text = entry_text(entry)
        if stream != "none":
            screen.feed(text)
        if entry.kind == END:
            ended = entry
    return ended


def error_pointer(ended: Entry, run_id: str) -> tuple[str, ...]:
    """What a view says of a run that ended in an error: that it did, and where its error is. Never the
    error itself: the cell (or ``%taas wait`` for a detached run) shows it once, and a page, or a notebook
    saved and reopened, must not read the same traceback twice."""
    if not ended.lines:
        return ()
    return (f"taas: the run {ended.text}; its error is in the cell's output (below this view, or where "
            f"%taas wait {run_id} ran)",)


def status_lines(displays: list[Entry]) -> tuple[dict[str, str], str]:
    """From the newest display of each id: the status lines (health, data) and the chart's SVG."""
    lines, chart = {}, ""
    for entry in displays:
        message = entry.message
        if not isinstance(message, Display) or not (entry.display_id or "").startswith(TAAS_DISPLAY_PREFIX):
            continue
        if "image/svg+xml" in message.data:
            chart = message.data["image/svg+xml"]
        elif message.data.get("text/plain"):
            lines[entry.display_id or ""] = message.data["text/plain"]
    return lines, chart


class View(Protocol):
    def push(self, entries: list[Entry]) -> None:
        """New entries, in order."""

    def ended(self) -> None:
        """The run's last entry was pushed."""


class LivePump:
    """Feeds one view from one log on a daemon thread, until the run's last entry (see the module docstring)."""

    def __init__(self, log: RunLog, view: View, name: str, on_end: Callable[[], None] | None = None):
        self.log, self.view = log, view
        self.seq = -1
        self.finished = False  # it showed the run's last entry: it will not read the log again
        self._on_end = on_end
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        while True:
            _, entries = self.log.since(self.seq)
            if entries:
                self.view.push(entries)
                self.seq = entries[-1].seq
                if entries[-1].kind == END:
                    self.view.ended()
                    self.finished = True
                    if self._on_end is not None:
                        self._on_end()
                    return
            self.log.wait(self.seq, 0.5)
            time.sleep(PUMP_SECONDS)  # what arrives meanwhile goes in one update

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)


class TextView:
    """A detached run's view in front ends without widgets: one text display updated in place
    (header, status lines, rank 0's last lines, how it ended) and the chart beside it."""

    def __init__(self, log: RunLog, publish: Callable[[Display], None]):
        self.log, self.publish = log, publish
        self.screen = Screen(TEXT_LINES)
        self.text_id, self.chart_id = f"taas-view-{log.run_id}", f"taas-view-chart-{log.run_id}"
        self.state, self.error = "running", tuple[str, ...]()
        self._chart = ""
        self._shown_at = 0.0
        self._show(update=False)  # both displays now, in the cell that detached: later they are updated in place
        self.publish(Display({"text/plain": ""}, {}, {"display_id": self.chart_id}, False))

    def push(self, entries: list[Entry]) -> None:
        ended = feed_screen(self.screen, entries)
        if ended is not None:
            self.state, self.error = ended.text, error_pointer(ended, self.log.run_id)
        if time.monotonic() - self._shown_at >= 0.5:
            self._show(update=True)

    def ended(self) -> None:
        self._show(update=True)

    def _show(self, update: bool) -> None:
        self._shown_at = time.monotonic()
        lines, chart = status_lines(self.log.displays())
        text = "\n".join([self.log.header_text, *lines.values(), *self.screen.shown(), *self.error,
                          f"taas run {self.log.run_id} · {self.state} · full log: {self.log.path}"])
        self.publish(Display({"text/plain": text}, {}, {"display_id": self.text_id}, update))
        if chart and chart != self._chart:
            self.publish(Display({"image/svg+xml": chart, "text/plain": "taas chart"}, {}, {"display_id": self.chart_id}, True))
            self._chart = chart
