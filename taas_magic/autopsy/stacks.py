"""The hang autopsy: where every rank still running is, when ``--timeout`` fires or the cell is interrupted.

Runs in the kernel, on a run's own thread (:func:`take`, then :func:`describe` and :func:`summary`),
and in a Ray host agent or Slurm task, which takes its own host's ranks' stacks (:func:`take`).

Each rank arms Python's faulthandler on :data:`~taas_magic.autopsy.dump.STACK_SIGNAL`
(autopsy/dump.py), which dumps every thread's frames from C, without the GIL, so a rank
blocked in C code holding it answers too. Here, on the host of the ranks (the kernel, or a
cluster host's agent), :func:`take` signals every armed rank and collects the dumps within
a deadline; then, in the kernel, :func:`describe` shows each rank's stacks with the cell's
own frames at their cell lines, and :func:`summary` says in one line where each rank is:

    ranks 0, 2, 3 wait in all_reduce (line 14); rank 1 is at line 9 in time.sleep
"""

from __future__ import annotations

import ast
import os
import re
import tempfile
import time
from dataclasses import dataclass
from typing import Mapping

from taas_magic.autopsy.dump import MAIN_PREFIX, STACK_SIGNAL
from taas_magic.tempdirs import spill_root, sweep_orphans

DIR_PREFIX = "taas-stacks-"
ANSWER_SECONDS = 1.0  # at most this long for the dumps (the budget is 2 s per stop)
QUIET_SECONDS = 0.05  # a dump that has not grown for this long is complete

_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')
_OWN_FILES = (os.sep + "taas_magic" + os.sep, os.sep + "threading.py", os.sep + "selectors.py")
_DIST = os.sep + os.path.join("torch", "distributed") + os.sep

Sources = Mapping[str, tuple[str, list[str]]]  # notebook file name -> (label, its lines): the cell, earlier cells


@dataclass(frozen=True)
class Frame:
    filename: str
    line: int
    function: str


@dataclass(frozen=True)
class Thread:
    ident: str
    main: bool
    frames: tuple[Frame, ...]  # outermost first, as a traceback reads

    @property
    def ours(self) -> bool:
        """A thread of taas's own (lifeline, output flush, data feed) or an idle pool thread."""
        return all(any(part in frame.filename for part in _OWN_FILES) for frame in self.frames)


def make_dir(run_id: str) -> str:
    """The run's owner-only folder for the ranks' stack files (what killed kernels left is swept)."""
    root = spill_root()
    sweep_orphans(root, DIR_PREFIX)
    return tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-{run_id}-", dir=root)


def take(targets: Mapping[int, tuple[int, str]], wait: float = ANSWER_SECONDS) -> dict[int, str]:
    """Signal every armed rank (``rank -> (pid, stack file)``); its dump, ``main`` line first.

    A rank that never armed (still starting) is not signalled: the signal would kill it. The
    file only grows (the rank appends), so a rank can be asked again: each dump is read from
    where the file ended when it was asked.
    """
    asked: dict[int, tuple[str, int]] = {}  # rank -> (its main line, the file's size when asked)
    for rank, (pid, path) in targets.items():
        text = _read(path)
        head = [line for line in text.splitlines() if line.startswith(MAIN_PREFIX)]
        if not head:
            continue
        try:
            os.kill(pid, STACK_SIGNAL)
        except OSError:
            continue
        asked[rank] = (head[-1], len(text.encode()))
    dumps: dict[int, str] = {}
    sizes: dict[int, tuple[int, float]] = {}
    deadline = time.monotonic() + wait
    while len(dumps) < len(asked) and time.monotonic() < deadline:
        time.sleep(0.01)
        now = time.monotonic()
        for rank in asked.keys() - dumps.keys():
            size = _size(targets[rank][1])
            before, since = sizes.get(rank, (-1, now))
            if size != before:
                sizes[rank] = (size, now)
            elif size > asked[rank][1] and now - since >= QUIET_SECONDS:
                dumps[rank] = _read(targets[rank][1], asked[rank][1])
    for rank in asked.keys() - dumps.keys():
        dumps[rank] = _read(targets[rank][1], asked[rank][1])  # what it wrote by the deadline
    return {rank: f"{asked[rank][0]}\n{dumps[rank]}" for rank in asked}


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _read(path: str, offset: int = 0) -> str:
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            return file.read().decode(errors="replace")
    except OSError:
        return ""


def parse(dump: str) -> list[Thread]:
    """faulthandler's text (innermost frame first) as threads, outermost frame first; main first."""
    main = ""
    threads: list[tuple[str, list[Frame]]] = []
    for line in dump.splitlines():
        if line.startswith(MAIN_PREFIX):
            main = line[len(MAIN_PREFIX):].strip()
        elif (match := _THREAD.match(line)) is not None:
            threads.append((match.group(2), []))
        elif (match := _FRAME.match(line)) is not None and threads:
            threads[-1][1].append(Frame(match.group(1), int(match.group(2)), match.group(3)))
    parsed = [Thread(ident, int(ident, 16) == int(main or "0", 16), tuple(reversed(frames))) for ident, frames in threads]
    return sorted(parsed, key=lambda thread: not thread.main)


def _where(frame: Frame, sources: Sources, cell: str) -> str:
    label, _ = sources.get(frame.filename, ("", []))
    if frame.filename == cell:
        return f"line {frame.line}"
    if label:
        return f"{label}, line {frame.line}"
    return f"{os.path.basename(frame.filename)}:{frame.line}"


def _source_line(frame: Frame, sources: Sources) -> str:
    _, lines = sources.get(frame.filename, ("", []))
    return lines[frame.line - 1].strip() if 0 < frame.line <= len(lines) else ""


def _called(text: str) -> str | None:
    """The outermost call on a line of source: ``time.sleep`` in ``time.sleep(100)``."""
    for candidate in (text, text + "\n    pass"):  # a statement, or the head of a block (``for x in f():``)
        try:
            tree = ast.parse(candidate)
            break
        except SyntaxError:
            continue
    else:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            try:
                return ast.unparse(node.func)
            except Exception:  # noqa: BLE001 - an exotic callee: say nothing rather than fail the autopsy
                return None
    return None


def position(threads: list[Thread], sources: Sources, cell: str) -> tuple[str, str]:
    """(verb phrase, where) of a rank's main thread: ``("wait in all_reduce", "line 14")``."""
    main = next((thread for thread in threads if thread.main), threads[0] if threads else None)
    if main is None or not main.frames:
        return ("did not answer", "")
    notebook = [frame for frame in main.frames if frame.filename in sources]
    here = notebook[-1] if notebook else main.frames[-1]
    where = _where(here, sources, cell)
    dist = [frame for frame in main.frames
            if _DIST in frame.filename and frame.function != "wrapper" and not frame.function.startswith("_")]
    if dist:
        return (f"wait in {dist[0].function}", where)
    if here is not main.frames[-1]:
        return (f"in {main.frames[-1].function}", where)
    called = _called(_source_line(here, sources)) if notebook else None
    return (f"in {called}" if called else f"in {here.function}", where)


def describe(rank: int, dump: str, sources: Sources, cell: str) -> list[str]:
    """Rank ``rank``'s threads as tracebacks (most recent call last), cell frames at their cell lines."""
    threads = parse(dump)
    if not threads:
        return [f"--- rank {rank}: no stack (it did not answer within {ANSWER_SECONDS:g} s) ---"]
    lines: list[str] = []
    own = sum(thread.ours for thread in threads if not thread.main)
    for thread in threads:
        if thread.ours and not thread.main:
            continue
        name = "main thread" if thread.main else f"thread {thread.ident}"
        lines.append(f"--- rank {rank}, {name} (most recent call last) ---")
        first = next((i for i, frame in enumerate(thread.frames) if frame.filename in sources), 0)
        for frame in thread.frames[first:]:  # from the cell down, as a cell's traceback reads (not taas's bootstrap)
            if frame.filename in sources:
                text = _source_line(frame, sources)
                lines.append(f"  {'Cell' if frame.filename == cell else sources[frame.filename][0]}, "
                             f"line {frame.line}, in {frame.function}" + (f"\n    {text}" if text else ""))
            else:
                lines.append(f'  File "{frame.filename}", line {frame.line}, in {frame.function}')
    if own:
        lines.append(f"    (rank {rank} also runs {own} thread{'s' if own != 1 else ''} of taas's own, not shown)")
    return lines


def summary(positions: Mapping[int, tuple[str, str]]) -> str:
    """One line for every rank: ranks at the same place are named together."""
    groups: dict[tuple[str, str], list[int]] = {}
    for rank in sorted(positions):
        groups.setdefault(positions[rank], []).append(rank)
    parts = []
    for (phrase, where), ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        if phrase.startswith("wait in "):
            verb = phrase if len(ranks) > 1 else "waits" + phrase[len("wait"):]
            parts.append(f"{who} {verb} ({where})")
        elif phrase == "did not answer":
            parts.append(f"{who} did not answer")
        else:
            parts.append(f"{who} {'are' if len(ranks) > 1 else 'is'} at {where} {phrase}")
    return "; ".join(parts)


def autopsy(dumps: Mapping[int, str], running: tuple[int, ...], sources: Sources, cell: str) -> list[str]:
    """The lines the cell shows: the one-line summary, then every running rank's stacks."""
    positions = {rank: position(parse(dumps.get(rank, "")), sources, cell) for rank in running}
    lines = ["taas: where the running ranks were: " + summary(positions)]
    for rank in running:
        lines.extend(describe(rank, dumps.get(rank, ""), sources, cell))
    return lines
