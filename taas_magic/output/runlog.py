"""The run log: everything one run shows, sequence-numbered, in the kernel and on disk.

Every line a run shows goes through a :class:`RunLog` before any view shows it: the header,
rank 0's output as the relay flushes it (``--output all``: every rank's, prefixed), taas's
own lines (restarts, where the ranks were, what the write rule diverted), the displays (the
ranks' own, the live chart, the health line, the data line), rank 0's chart points, and the
run's last entry (how it ended). Each entry gets the next sequence number, so a view that
was away (a reloaded page, ``%taas attach``) asks for what follows the last number it saw
and misses nothing.

Where it is kept:

- in the kernel, while the run's views may still ask for them, the last entries up to
  ``keep_bytes`` (4 MiB: a run printing a million lines, or reporting a million times,
  holds the same memory as one printing ten thousand; a ``points`` entry counts what its
  reports hold in memory), plus the newest display of each
  display id (the chart, the health line), which a view that comes back shows at once; once
  the run ended and was taken, only its last entry (:meth:`RunLog.forget`);
- on disk, every entry as one JSON line in ``<log dir>/<run id>.run.jsonl`` (owner-only,
  beside the cell's elided-output log, output/budget.py), flushed as it is written: the
  record a person reads on Monday. The chart's SVG is left out there (its points are in the
  ``points`` entries; the SVG is redrawn from them), so a two-day run's log grows with what it
  printed, not with how often its chart was redrawn.
  The folder is pruned as a run starts, at most every 10 minutes and off the cell's path
  (:func:`prune_logs`): a log file untouched for 30 days is removed, and beyond the newest
  1,000 log files the oldest are.

Runs in the kernel: written by the run's own thread and read by the views (the cell's stream on
the kernel's main thread, the live widget's pump thread), with one lock and listeners called after
each entry (they only wake their reader); old logs are pruned on a helper thread.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable

from taas_magic.output.budget import log_dir
from taas_magic.output.relay import ClearOutput, Display

KEEP_BYTES = 4 << 20  # entries kept in the kernel for views that come back (the rest is on disk)
# what one of rank 0's reports holds in the kernel: its tuple, dict and numbers (measured: about 340 bytes with
# one metric, 1.4 KB with twelve), so that a points entry counts what it costs, not a tenth of it
REPORT_BYTES, METRIC_BYTES = 250, 100
HEADER, OUT, SAY, DISPLAY, POINTS, END = "header", "out", "say", "display", "points", "end"
PDB = "pdb"  # a rank's pdb session as the console showed it (kernel/supervision/prompts.py): on disk, not in the views
# the log folder's pruning rule, applied when a run starts (at most every PRUNE_EVERY seconds, on a thread of its
# own: a folder of 1,000 logs takes 8 ms to read): a log untouched for KEEP_LOG_DAYS goes, and past the newest
# KEEP_LOGS log files the oldest go (a run still writing is among the newest: its file is touched)
KEEP_LOG_DAYS, KEEP_LOGS, PRUNE_EVERY = 30, 1000, 600.0
LOG_SUFFIXES = (".run.jsonl", ".log")  # a run's log and the cell's elided-output log (output/budget.py)


@dataclass(frozen=True)
class Entry:
    """One thing the run showed: ``header`` (the run's first lines), ``out`` (text on ``stream``), ``say``
    (taas's own line), ``display``
    (a display message), ``points`` (rank 0's reports for the chart), ``end`` (how it ended)."""

    seq: int
    at: float  # time.time()
    kind: str
    stream: str = ""  # out: "stdout" or "stderr"
    text: str = ""  # out, say: the text; end: "ok", "failed" or "stopped"
    message: Display | ClearOutput | None = None  # display
    lines: tuple[str, ...] = ()  # end: the error as the cell shows it
    reports: tuple = ()  # points: (step, {metric: value}) of rank 0

    @property
    def display_id(self) -> str | None:
        if isinstance(self.message, Display):
            return self.message.transient.get("display_id")
        return None

    def size(self) -> int:
        if isinstance(self.message, Display):
            return 64 + sum(len(str(value)) for value in self.message.data.values())
        return (64 + len(self.text) + sum(len(line) for line in self.lines)
                + sum(REPORT_BYTES + METRIC_BYTES * len(metrics) for _, metrics in self.reports))

    def record(self) -> dict:
        """The entry as its JSON line on disk (a chart's SVG left out: its points are logged)."""
        row: dict = {"seq": self.seq, "at": round(self.at, 3), "kind": self.kind}
        if self.stream:
            row["stream"] = self.stream
        if self.text:
            row["text"] = self.text
        if self.lines:
            row["lines"] = list(self.lines)
        if self.reports:
            row["reports"] = [[step, metrics] for step, metrics in self.reports]
        if isinstance(self.message, Display):
            data = {mime: (value if mime != "image/svg+xml" else f"<svg: {len(value)} characters>")
                    for mime, value in self.message.data.items()}
            row.update(data=data, display_id=self.display_id, update=self.message.update)
        elif isinstance(self.message, ClearOutput):
            row["clear"] = True
        return row


@dataclass
class _Kept:
    entries: collections.deque = field(default_factory=collections.deque)
    bytes: int = 0
    displays: dict[str, Entry] = field(default_factory=dict)  # display id -> its newest display


class RunLog:
    """One run's log (see the module docstring). ``path`` is its file on disk."""

    def __init__(self, run_id: str, keep_bytes: int = KEEP_BYTES, directory: str | None = None):
        self.run_id, self.keep_bytes = run_id, keep_bytes
        folder = directory or log_dir()
        os.makedirs(folder, mode=0o700, exist_ok=True)
        _prune_soon(folder)
        self.path = os.path.join(folder, f"{run_id}.run.jsonl")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # output may hold secrets
        self._file: IO[str] | None = open(fd, "w", encoding="utf-8", errors="replace")
        self._lock = threading.Condition()
        self._kept = _Kept()
        self._listeners: list[Callable[[], None]] = []
        self.next_seq = 0
        self.ended: Entry | None = None
        self.last_line = ""  # the last whole line rank 0 printed (for %taas runs)
        self._partial = ""
        self._header = ""

    # -- writing (the run's thread) -------------------------------------------------------------
    def out(self, stream: str, text: str) -> None:
        if text:
            self._append(OUT, stream=stream, text=text)

    def header(self, text: str) -> None:
        self._append(HEADER, stream="stdout", text=text)

    @property
    def header_text(self) -> str:
        return self._header

    def say(self, line: str, stream: str = "stdout") -> None:
        self._append(SAY, stream=stream, text=line)

    def debugger(self, text: str) -> None:
        """What a rank's pdb showed at a prompt, or the person's line: the console cell shows it itself."""
        self._append(PDB, stream="stdout", text=text)

    def publish(self, message: Display | ClearOutput) -> None:
        self._append(DISPLAY, message=message)

    def points(self, reports: list) -> None:
        if reports:
            self._append(POINTS, reports=tuple(reports))

    def end(self, state: str, lines: tuple[str, ...] = ()) -> None:
        """The run's last entry: ``ok``, ``failed`` or ``stopped``, and the error as the cell shows it."""
        if self.ended is None:
            self._append(END, text=state, lines=lines)

    def stream(self, name: str) -> "LogStream":
        """A file-like ``write``/``flush`` into this log (the relay writes rank output to it)."""
        return LogStream(self, name)

    def _append(self, kind: str, **fields: object) -> None:
        with self._lock:
            entry = Entry(self.next_seq, time.time(), kind, **fields)  # type: ignore[arg-type]  # fields are Entry's
            self.next_seq += 1
            self._keep(entry)
            if self._file is not None:
                self._file.write(json.dumps(entry.record(), default=str) + "\n")
                self._file.flush()
            if kind == END:
                self.ended = entry
                self._close_file()
            self._lock.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def _keep(self, entry: Entry) -> None:
        kept = self._kept
        display_id = entry.display_id
        if display_id is not None:
            kept.displays[display_id] = entry
        if entry.kind == HEADER:
            self._header = entry.text
        if entry.kind == OUT and entry.stream == "stdout":
            self._track_last_line(entry.text)
        kept.entries.append(entry)
        kept.bytes += entry.size()
        while kept.bytes > self.keep_bytes and len(kept.entries) > 1:
            kept.bytes -= kept.entries.popleft().size()

    def _track_last_line(self, text: str) -> None:
        combined = (self._partial + text)[-4096:]
        lines = combined.replace("\r", "\n").split("\n")
        self._partial = lines[-1]
        whole = [line for line in lines[:-1] if line.strip()]
        if whole:
            self.last_line = whole[-1]

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self) -> None:
        """The file is closed (a run that never ended: its plan failed)."""
        with self._lock:
            self._close_file()

    def forget(self) -> None:
        """The run ended and nothing will show its entries again (kernel/runs/background.py's let_go): the kernel
        keeps only its last entry (how it ended), so a view that comes back still sees it end; the rest is
        in the file."""
        with self._lock:
            if self.ended is None:
                return
            self._kept = _Kept(collections.deque([self.ended]), self.ended.size())

    # -- reading (the views) --------------------------------------------------------------------
    def since(self, seq: int) -> tuple[int, list[Entry]]:
        """The entries after ``seq`` still kept in the kernel, and the first sequence number kept
        (greater than ``seq + 1`` when older ones are only on disk)."""
        with self._lock:
            entries = self._kept.entries
            first = entries[0].seq if entries else self.next_seq
            if seq + 1 >= first:
                start = seq + 1 - first
                return first, [entries[index] for index in range(start, len(entries))]
            return first, list(entries)

    def displays(self) -> list[Entry]:
        """The newest display of each display id (a view that comes back shows them at once)."""
        with self._lock:
            return list(self._kept.displays.values())

    def wait(self, seq: int, timeout: float) -> bool:
        """Until an entry after ``seq`` exists (True) or ``timeout`` passed."""
        with self._lock:
            return self._lock.wait_for(lambda: self.next_seq > seq + 1, timeout)

    def listen(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener`` after each entry (from the writing thread); returns what stops it."""
        with self._lock:
            self._listeners.append(listener)

        def stop() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return stop

    @property
    def kept_bytes(self) -> int:
        return self._kept.bytes


_pruned_at: dict[str, float] = {}  # folder -> when it was last pruned (time.monotonic())


def _prune_soon(folder: str) -> None:
    """Prune ``folder`` on a daemon thread, unless it was pruned in the last PRUNE_EVERY seconds."""
    now = time.monotonic()
    if now - _pruned_at.get(folder, -PRUNE_EVERY) < PRUNE_EVERY:
        return
    _pruned_at[folder] = now
    threading.Thread(target=prune_logs, args=(folder,), name="taas-prune-logs", daemon=True).start()


def prune_logs(folder: str, days: float = KEEP_LOG_DAYS, most: int = KEEP_LOGS) -> list[str]:
    """The log folder's pruning rule (above): what it removed. Only files this module and output/budget.py
    name (``<run id>.run.jsonl``, ``<run id>.log``); a file that vanishes meanwhile is skipped."""
    found = []
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.endswith(LOG_SUFFIXES) and entry.is_file(follow_symlinks=False):
                try:
                    found.append((entry.stat(follow_symlinks=False).st_mtime, entry.path))
                except FileNotFoundError:
                    continue
    found.sort(reverse=True)
    cutoff = time.time() - days * 86400
    removed = [path for index, (mtime, path) in enumerate(found) if index >= most or mtime < cutoff]
    for path in removed:
        try:
            os.unlink(path)
        except OSError:  # gone meanwhile, or not ours to remove: left as it is
            pass
    return removed


class LogStream:
    """``write``/``flush`` for the relay: rank text into the log on one stream."""

    def __init__(self, log: RunLog, name: str):
        self.log, self.name = log, name

    def write(self, text: str) -> int:
        self.log.out(self.name, text)
        return len(text)

    def flush(self) -> None:
        pass
