"""A rank's half of JupyterLab's debugger panel: a ``bdb`` tracer that stops the cell where the panel says.

Runs in each rank: :class:`RankTracer` on the cell's thread (it is that thread's trace function, and
serves the panel's questions there while the rank is stopped); :func:`now` on the inbox's reader
thread (rank/inbox.py), for what must act while the cell runs (new breakpoints, pause).

Installed only when the kernel's spec says the panel is on (``RunSpec.panel``): with the panel off,
no trace function is set and the cell runs exactly as without this module. The breakpoints come in
the spec, so they hold from the cell's first line; those set later come as ``PanelNow``. The cell is
compiled as ``<taas In[n]>`` (rank/execute.py, with the person's line numbers), and the panel knows
it by ipykernel's cell file (``PanelPlan.path``): breakpoints in that file are placed in the cell's
code, and the cell's frames are shown under that path (debugger/frameview.py).

At a stop the rank says ``PanelStopped`` (the kernel then holds the other ranks as the pdb prompt
does: kernel/supervision/prompts.py), answers each ``PanelCommand`` with a ``PanelReply``, and goes on
at ``continue``, ``next``, ``stepIn``, ``stepOut`` or ``disconnect``, saying ``PanelResumed`` after its
reply. Nothing here opens a port: every frame goes over the rank's own channel to the kernel.
"""

from __future__ import annotations

import bdb
import functools
import inspect
import os
import site
import sys
import sysconfig
import threading
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable

from taas_magic.debugger.frameview import FrameView
from taas_magic.debugger.ranklink import PanelCommand, PanelNow
from taas_magic.protocol import ToKernel
from taas_magic.runspec import PanelPlan

RESUMING = ("continue", "next", "stepIn", "stepOut", "disconnect")
STEPPING = ("next", "stepIn", "stepOut")
# Python's own library and installed packages: a step or a pause never stops in them (as ipykernel's debugger, with
# debugpy's justMyCode), only a breakpoint placed there does. A pause stopped once in a weakref callback the garbage
# collector ran on the cell's thread before the cell's first line (_weakrefset.py).
CELLS = ("<taas In[", "<ipython-input-")  # the file names of the cells a rank runs (rank/execute.py) and IPython's
LIBRARY = tuple(sorted({os.path.join(os.path.realpath(path), "") for path in (
    *(sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib", "purelib", "platlib")),
    *site.getsitepackages(), site.getusersitepackages())}))


@functools.lru_cache(maxsize=4096)
def is_library(filename: str) -> bool:
    """Whether a code object's file is Python's or an installed package's, or generated code not a cell's."""
    if filename.startswith("<"):  # made, not read from a file: a notebook cell's is the person's (<taas In[3]>,
        return not filename.startswith(CELLS)  # <ipython-input-…>); a dataclass's or namedtuple's methods
        # (<string>), torch.fx's code (<eval_with_key>.3) or importlib's (<frozen …>) have no source to show
    return os.path.realpath(filename).startswith(LIBRARY)


@dataclass(frozen=True)
class PanelStopped(ToKernel, kind="panel-stopped"):
    """The rank stopped (``reason``: breakpoint, step or pause): the panel's ``stopped`` event, this rank's thread."""

    reason: str
    line: int  # where, in the innermost frame shown


@dataclass(frozen=True)
class PanelReply(ToKernel, kind="panel-reply"):
    """The answer to the kernel's ``PanelCommand`` number ``seq``: a DAP body, or why not (``error``)."""

    seq: int
    body: dict | None
    error: str = ""


@dataclass(frozen=True)
class PanelResumed(ToKernel, kind="panel-resumed"):
    """The rank runs again after a stop (the panel's ``continued``); ``stepping``: to stop again at a step, or let go
    by the panel's disconnect (either way no other stopped rank is said stopped again in its place)."""

    stepping: bool = False


class RankTracer(bdb.Bdb):
    """The cell's trace function while the panel is on (see the module docstring)."""

    def __init__(self, inbox: Any, plan: PanelPlan, cell_file: str):
        super().__init__(skip=["taas_magic.*"])  # taas's own frames are not the person's: never stopped in
        self.inbox, self.plan, self.cell_file = inbox, plan, cell_file
        self.thread = threading.get_ident()
        self._pausing = False
        self._stepping = False  # stepping or pausing: every event to bdb (not bdb's stoplineno: -1 in a generator's
        # step out, as in a continue)
        self._lines_by_file: dict[str, set[int]] = {}
        self.place(plan.breakpoints)

    def place(self, breakpoints: tuple[tuple[str, tuple[int, ...]], ...]) -> None:
        """The panel's breakpoints, every file's (a cell's are placed in the cell's code)."""
        self.clear_all_breaks()
        for path, lines in breakpoints:
            filename = self.cell_file if path == self.plan.path else path
            for line in lines:
                self.set_break(filename, line)  # a blank line's is refused (bdb says why): the panel shows it unverified
        # the frames running now see the change (the cell's thread adds files meanwhile; a kept line stays in its set)
        for filename, known in list(self._lines_by_file.items()):
            now = set(self.breaks.get(self.canonic(filename), ()))
            known.intersection_update(now)
            known.update(now)

    def start(self) -> None:
        """From the caller's next call on (the cell's code), stop only at breakpoints."""
        self.reset()
        caller = inspect.currentframe().f_back  # type: ignore[union-attr]  # CPython has frames
        self.botframe = caller
        if self._pausing:  # a pause asked before the cell began: its first line of the person's
            self._stepping = True
            self._stop_info(None, 0)
        else:
            self._stop_info(caller, -1)  # bdb's "continue", its trace function kept
        sys.settrace(self._on_call)

    def _stop_info(self, frame: FrameType | None, line: int) -> None:
        self._set_stopinfo(frame, None, line)  # type: ignore[attr-defined]  # private API: see taas_magic/private.py

    def finish(self) -> None:
        sys.settrace(None)

    def trace_running_frames(self) -> None:
        """From the reader's thread: the cell's frames now running get the trace function, so a new breakpoint
        or a pause is seen in a frame that began without one (a loop already running)."""
        frame = sys._current_frames().get(self.thread)  # private API: see taas_magic/private.py
        while frame is not None:
            if frame.f_trace is None and not self.is_skipped_module(frame.f_globals.get("__name__", "")):
                frame.f_trace = self._tracing(self._lines_in(frame.f_code.co_filename))
            frame = frame.f_back

    # -- the trace functions: bdb's own only where it may stop ---------------------------------------
    # Running on (bdb's "continue": no stop but at a breakpoint), a frame of a file with no breakpoint is not traced,
    # and in one with breakpoints only their lines reach bdb, through a closure per frame holding its file's lines:
    # bdb's Python dispatch on every line made a Python-bound loop 39x slower (bench/debugpanel.py). Stepping or pausing,
    # every event goes to bdb.
    def _lines_in(self, filename: str) -> set[int]:
        """The breakpoint lines in a code object's file (by its ``co_filename``): one set per file, updated in place
        by :meth:`place`, so the frames' trace functions see new breakpoints."""
        lines = self._lines_by_file.get(filename)
        if lines is None:
            lines = self._lines_by_file[filename] = set(self.breaks.get(self.canonic(filename), ()))
        return lines

    def _on_call(self, frame: FrameType, event: str, arg: Any) -> Any:
        """The thread's trace function: a new frame."""
        lines = self._lines_in(frame.f_code.co_filename)
        if not self._stepping and not lines:
            return None
        return self._tracing(lines) if self.trace_dispatch(frame, event, arg) is not None else None

    def _tracing(self, lines: set[int]) -> Callable[[FrameType, str, Any], Any]:
        """A frame's trace function (its file's breakpoint ``lines``)."""
        dispatch = self.trace_dispatch

        def on_event(frame: FrameType, event: str, arg: Any) -> Any:
            if self._stepping or (event == "line" and frame.f_lineno in lines):
                dispatch(frame, event, arg)
            return on_event
        return on_event

    def pause(self) -> None:
        self._pausing = self._stepping = True
        self._stop_info(None, 0)  # bdb's "step": the next line of any frame of the person's
        self.trace_running_frames()

    def stop_here(self, frame: FrameType) -> bool:
        """bdb's step and pause stops: only in the person's code (``break_here`` still stops at any breakpoint). A
        step out that returns into the library (a method ``nn.Module.__call__`` called) goes on to the person's next
        line."""
        if not super().stop_here(frame):
            return False
        filename = frame.f_code.co_filename
        if not is_library(filename) or self._lines_in(filename):
            return True  # the person's code, or a library file the person placed a breakpoint in: stepped in too
        if frame is self.stopframe:
            self._stop_info(None, 0)
        return False

    # -- at a stop: the cell's thread ----------------------------------------------------------------
    def user_line(self, frame: FrameType) -> None:
        if self._pausing:
            reason = "pause"
        elif self.get_breaks(self.canonic(frame.f_code.co_filename), frame.f_lineno):
            reason = "breakpoint"
        else:
            reason = "step"
        self._pausing = False
        self.interaction(frame, reason)

    def interaction(self, frame: FrameType, reason: str) -> None:
        stack, _ = self.get_stack(frame, None)
        frames = [each for each, _ in stack]
        first = next((index for index, each in enumerate(frames) if each.f_code.co_filename == self.cell_file), 0)
        view = FrameView(frames[first:][::-1], self.cell_file, self.plan.path)
        self.inbox.send(PanelStopped(reason, frame.f_lineno))
        resumed = serve_stop(self.inbox, view, lambda name: self._resume(name, frame))
        self.inbox.send(PanelResumed(stepping=resumed in STEPPING + ("disconnect",)))

    def _resume(self, name: str, frame: FrameType) -> dict:
        self._stepping = name in STEPPING
        if self._stepping:
            self.trace_running_frames()  # a caller left untraced (no breakpoint in its file) stops a step out too
        if name == "next":
            self.set_next(frame)
        elif name == "stepIn":
            self.set_step()
        elif name == "stepOut":
            self.set_return(frame)
        else:
            if name == "disconnect":
                self.place(())
            self._stop_info(self.botframe, -1)
        return {"allThreadsContinued": False}


def serve_stop(inbox: Any, view: FrameView, resume: Callable[[str], dict]) -> str:
    """At a stop, on the cell's thread: the panel's commands answered (``PanelReply``) until one resumes the rank
    (``resume(name)`` sets where it stops next); that command's name."""
    answers = {"stackTrace": view.stack_trace, "scopes": view.scopes, "variables": view.variables,
               "evaluate": view.evaluate, "richInspectVariables": view.rich_inspect, "copyToGlobals": view.copy}
    while True:
        command = inbox.take(lambda each: isinstance(each, PanelCommand))
        name, arguments = command.command, command.arguments
        try:
            if name in answers:
                body: dict = answers[name](arguments)
            elif name in RESUMING:
                body = resume(name)
            else:
                body = {}  # pause at a stop, and what a stopped rank has nothing to say about
        except Exception as exc:  # noqa: BLE001 - the person's expression, a stale id: said in the panel
            inbox.send(PanelReply(command.seq, None, f"{type(exc).__name__}: {exc}"))
            continue
        inbox.send(PanelReply(command.seq, body))
        if name in RESUMING:
            return name


_tracer: RankTracer | None = None
_pause_asked = False  # a pause that came before the cell's tracer was made: it stops at the cell's first line


def install(inbox: Any, plan: PanelPlan | None, cell_file: str) -> RankTracer | None:
    """Each cell, on its thread: a tracer when the panel is on, else none (and none left from an earlier cell)."""
    global _tracer, _pause_asked
    _tracer = RankTracer(inbox, plan, cell_file) if plan is not None else None
    if _tracer is not None and _pause_asked:
        _tracer._pausing = True  # start() stops at the cell's first line
    _pause_asked = False
    return _tracer


def now(frame: PanelNow) -> None:
    """On the inbox's reader: new breakpoints, or a pause, for the cell that runs now (none: nothing to do)."""
    global _pause_asked
    tracer = _tracer
    if tracer is None:
        _pause_asked = _pause_asked or frame.pause
        return
    if frame.breakpoints is not None:
        tracer.place(frame.breakpoints)
        tracer.trace_running_frames()
    if frame.pause:
        tracer.pause()
