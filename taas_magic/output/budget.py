"""The cell's output budget: the first lines, then the last ones, and the rest in a log file.

Runs in the kernel, on the cell's thread, where the cell's stream (output/cellstream.py) shows the
run's log.

A rank printing 200,000 lines must not freeze the browser or exceed Jupyter's iopub data rate. The
cell's stream (output/cellstream.py) passes every text it is about to write through
:class:`OutputBudget`: up to ``head_lines`` lines (or ``head_bytes`` bytes of whole lines) go to the
cell as they come. Past that, nothing more is written to the cell while the run lasts; everything,
from the first line on, goes to a log file, and the last ``tail_lines`` lines are kept. When the run
ends the cell gets one notice, ``[taas] N lines elided, full log at PATH``, and those last lines.
Text ending in ``\\r`` (progress bars redrawing a line) counts as no line and no bytes until a
``\\n`` completes it.
"""

from __future__ import annotations

import collections
import os
import tempfile
from typing import IO

HEAD_LINES = 5000
HEAD_BYTES = 1 << 20
TAIL_LINES = 200


def log_dir() -> str:
    return os.environ.get("TAAS_LOG_DIR") or os.path.join(tempfile.gettempdir(), f"taas-logs-{os.getuid()}")


class OutputBudget:
    def __init__(self, run_id: str, head_lines: int = HEAD_LINES, head_bytes: int = HEAD_BYTES, tail_lines: int = TAIL_LINES):
        self.run_id = run_id
        self.head_lines, self.head_bytes = head_lines, head_bytes
        self.lines = 0
        self.bytes = 0
        self.head: list[str] = []  # what the cell showed, for the log, until eliding starts
        self.log: IO[str] | None = None
        self.path = ""
        self.tail: collections.deque[tuple[str, str]] = collections.deque(maxlen=tail_lines)
        self.tail_partial: dict[str, str] = {"stdout": "", "stderr": ""}
        self.elided = 0  # lines not shown while the run went on

    @property
    def eliding(self) -> bool:
        return self.log is not None

    def admit(self, stream: str, text: str) -> str:
        """The part of ``text`` to write to the cell now; the rest goes to the log."""
        if self.eliding:
            self._divert(stream, text)
            return ""
        newlines = text.count("\n")
        whole = text.rfind("\n") + 1
        if self.lines + newlines <= self.head_lines and self.bytes + whole <= self.head_bytes:
            self.lines += newlines
            self.bytes += whole
            self.head.append(text)
            return text
        cut = 0
        for line in text.splitlines(keepends=True):
            if not line.endswith("\n"):
                break
            if self.lines + 1 > self.head_lines or self.bytes + len(line) > self.head_bytes:
                break
            self.lines += 1
            self.bytes += len(line)
            cut += len(line)
        shown = text[:cut]
        self.head.append(shown)
        self._start_log()
        self._divert(stream, text[cut:])
        return shown

    def _start_log(self) -> None:
        os.makedirs(log_dir(), mode=0o700, exist_ok=True)
        self.path = os.path.join(log_dir(), f"{self.run_id}.log")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # output may hold secrets
        self.log = open(fd, "w", encoding="utf-8", errors="replace")
        self.log.write("".join(self.head))
        self.head.clear()

    def _divert(self, stream: str, text: str) -> None:
        if not text:
            return
        assert self.log is not None
        self.log.write(text)
        pieces = (self.tail_partial[stream] + text).split("\n")
        self.tail_partial[stream] = pieces.pop()
        self.elided += len(pieces)
        for line in pieces[-(self.tail.maxlen or 0):]:
            self.tail.append((stream, line + "\n"))

    def finish(self) -> list[tuple[str, str]]:
        """What the cell gets at the end: the notice and the last lines (nothing if none elided)."""
        if self.log is None:
            return []
        for stream, partial in self.tail_partial.items():
            if partial:
                self.tail.append((stream, partial + "\n"))
                self.elided += 1
        self.log.close()
        hidden = self.elided - len(self.tail)
        notice = [("stdout", f"\n[taas] {hidden} lines elided, full log at {self.path}\n")] if hidden > 0 else []
        return notice + list(self.tail)
