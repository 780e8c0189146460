"""A run's log shown as the cell's own output: today's stream output, through the cell's budget.

Runs in the kernel, on the main thread of the cell that shows the log.

The view for front ends without widgets, and for ``%taas attach`` there: it reads the run log
(output/runlog.py) from a sequence number on and shows each entry in the cell that called
it, from the kernel's main thread (so IPython's streams and display publisher address that
cell): rank text through the output budget (output/budget.py: the first lines, then only
the log file and the last lines at the end), taas's own lines as they are, displays (the
ranks' own, the chart, the health line) through ``publish``. :meth:`finish` adds the
budget's notice and last lines once the run has ended.

With ``displays_only`` (a live widget shows the rest) only the ranks' own displays reach the
cell: the widget cannot render them, the cell can.
"""

from __future__ import annotations

from taas_magic.output.budget import OutputBudget
from taas_magic.output.relay import Publish, TextOut
from taas_magic.output.runlog import DISPLAY, HEADER, OUT, SAY, Entry, RunLog

TAAS_DISPLAY_PREFIX = "taas-"  # the chart, the health line, the data line: a live widget shows them itself


class CellStream:
    """Show a run log's entries in the current cell (see the module docstring)."""

    def __init__(self, log: RunLog, streams: dict[str, TextOut], publish: Publish, budget: OutputBudget | None,
                 displays_only: bool = False):
        self.log, self.streams, self.publish, self.budget = log, streams, publish, budget
        self.displays_only = displays_only
        self.seq = -1  # the last entry shown

    def show_new(self) -> bool:
        """Show what arrived since the last call; True if there was anything."""
        first, entries = self.log.since(self.seq)
        if first > self.seq + 1:  # older entries are only on disk now
            self._write("stderr", f"[taas] entries {self.seq + 1}..{first - 1} are in {self.log.path}\n")
        for entry in entries:
            self._show(entry)
            self.seq = entry.seq
        return bool(entries)

    def _show(self, entry: Entry) -> None:
        if entry.kind == DISPLAY and entry.message is not None:
            own = (entry.display_id or "").startswith(TAAS_DISPLAY_PREFIX)
            if not (self.displays_only and own):
                self.publish(entry.message)
        elif self.displays_only:
            return
        elif entry.kind == OUT:
            text = self.budget.admit(entry.stream, entry.text) if self.budget is not None else entry.text
            self._write(entry.stream, text)
        elif entry.kind in (SAY, HEADER):
            self._write(entry.stream, entry.text + "\n")

    def say(self, line: str) -> None:
        """One line of the kernel's own in the cell, in its place among the entries shown (even displays only)."""
        self._write("stdout", line + "\n")

    def _write(self, name: str, text: str) -> None:
        if text:
            self.streams[name].write(text)
            self.streams[name].flush()

    def finish(self) -> None:
        """The run has ended and everything was shown: the budget's notice and last lines, if it elided any."""
        if self.budget is None or self.displays_only:
            return
        runs: list[tuple[str, list[str]]] = []  # consecutive lines of one stream: one write
        for name, text in self.budget.finish():
            if runs and runs[-1][0] == name:
                runs[-1][1].append(text)
            else:
                runs.append((name, [text]))
        for name, texts in runs:
            self._write(name, "".join(texts))
