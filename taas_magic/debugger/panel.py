"""The kernel's half of JupyterLab's debugger panel: a DAP multiplexer over ipykernel's debugger and the ranks.

Runs in the kernel: :meth:`Panel.request` on ipykernel's control thread, where every ``debug_request``
arrives (it replaces the kernel's ``do_debug_request``, ipykernel's public hook for them);
:meth:`Panel.for_run` on the cell's thread, as a run is planned.

A request about a taas cell or a rank's thread is answered here; every other one goes to ipykernel's own
debugger (debugpy) unchanged, so plain cells keep theirs:

- ``dumpCell`` goes to ipykernel (it writes the cell's file and answers its ``sourcePath``); a cell with
  a ``#pragma taas`` line is remembered as a taas cell by that path.
- ``setBreakpoints`` in a taas cell is kept here and answered verified (debugpy never runs that file:
  the kernel runs only the cell's ``await``); in any other file it goes to ipykernel too, and is kept for
  the ranks, which run functions an earlier cell defined. The ranks that run now get them at once
  (``PanelNow``), fresh ranks in their spec before the cell's first line (``RunSpec.panel``).
- ``threads`` and ``debugInfo`` are ipykernel's answers with the ranks added (their threads, the taas
  cells' breakpoints, the stopped ranks), so a page that reloads finds the panel as it was.
- ``stackTrace``, ``scopes``, ``variables``, ``evaluate``, ``richInspectVariables``, ``copyToGlobals``,
  ``continue``, ``next``, ``stepIn``, ``stepOut`` and ``pause`` with a rank's thread, frame or variables id go
  to that rank (debugger/ranklink.py), the ids made the rank's own on the way and unique again on the way back;
  ``copyToGlobals`` binds the rank's value in the notebook.
- ``pause`` of any other thread while a taas cell runs pauses every rank: JupyterLab's pause button names the
  stopped thread, or debugpy's first when none is (the kernel's own threads wait for the run meanwhile).
- ``disconnect`` lets every stopped rank go, forgets the breakpoints, then goes to ipykernel.
"""

from __future__ import annotations

import asyncio
import pickle
import queue
import re
import threading
from typing import Any, Callable

from taas_magic.debugger.ranklink import PanelNow, RankLink, panel_id, rank_of, thread_rank
from taas_magic.runspec import PanelPlan

Original = Callable[[dict], Any]  # ipykernel's do_debug_request: a coroutine of a reply
BY_THREAD = ("stackTrace", "continue", "next", "stepIn", "stepOut", "pause")
BY_FRAME = ("scopes", "evaluate", "richInspectVariables")
BY_ID = {"variables": "variablesReference", "copyToGlobals": "srcFrameId"}  # the argument naming a rank's frame or values
FRAME_KEYS = ("frameId", "srcFrameId", "variablesReference")  # the ids of a rank's, made its own on the way
PRAGMA = re.compile(r"^\s*#\s*pragma\s+taas(?=\s|$)")  # a taas cell's line (cell/pragma.py's PRAGMA_RE)
ANSWER_SECONDS = 60.0  # a stopped rank answers at once; one that does not is gone or stuck in C code


class Panel:
    """The panel's requests for this kernel (see the module docstring)."""

    def __init__(self, original: Original, publish: Callable[[dict], None], namespace: dict):
        self.original, self.publish, self.namespace = original, publish, namespace  # the notebook's globals
        self.on = False  # initialized and not disconnected
        self.cells: dict[str, str] = {}  # the file the panel knows a taas cell by -> its text (dumpCell)
        self.breakpoints: dict[str, list[dict]] = {}  # file -> the panel's breakpoints, as it sent them
        self.link: RankLink | None = None  # the ranks of the run now

    # -- the cell's thread -----------------------------------------------------------------------
    def plan(self, cell: str) -> PanelPlan | None:
        """The ranks' plan for ``cell`` (as the person wrote it); None while the panel is off: no tracer in them.
        Its file is the one the panel dumped this text as (it dumps a cell before it sets breakpoints in it), else
        the one ipykernel would name it (``get_file_name``)."""
        from ipykernel.compiler import get_file_name

        if not self.on:
            return None
        text = cell.rstrip()
        path = next((path for path, dumped in self.cells.items() if dumped.rstrip() == text), get_file_name(cell))
        return PanelPlan(path, self._lines())

    def for_run(self, ranks: int) -> RankLink:
        """The run's ranks as the panel's threads: the run that starts now is the one the panel sees."""
        self.link = RankLink(ranks, self.publish)
        return self.link

    def _lines(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return tuple((path, tuple(int(each["line"]) for each in marks)) for path, marks in self.breakpoints.items())

    # -- the control thread ----------------------------------------------------------------------
    async def request(self, message: dict) -> dict:
        command, arguments = message.get("command", ""), message.get("arguments") or {}
        rank = self._rank_named(command, arguments)
        if rank is not None:
            return await self._to_rank(message, rank)
        if command == "pause" and self.link is not None and self.link.running:
            self.link.tell_all(PanelNow(pause=True))  # every rank of the run now
            return _reply(message, {})
        if command == "setBreakpoints":
            return await self._set_breakpoints(message)
        if command == "disconnect":
            self._disconnect()
        reply = await self.original(message)
        if command == "initialize" and reply.get("success", True):
            self.on = True
        elif command == "dumpCell" and _is_taas_cell(arguments.get("code", "")):
            self.cells[reply.get("body", {}).get("sourcePath", "")] = arguments["code"]
        elif command == "threads" and self.link is not None:
            reply.setdefault("body", {}).setdefault("threads", []).extend(self.link.threads())
        elif command == "debugInfo":
            self._add_to_info(reply.setdefault("body", {}))
        return reply

    def _rank_named(self, command: str, arguments: dict) -> int | None:
        link = self.link
        if link is None:
            return None
        if command in BY_THREAD:
            return thread_rank(int(arguments.get("threadId", 0)), link.ranks)
        key = BY_ID.get(command, "frameId" if command in BY_FRAME else "")
        found = rank_of(int(arguments.get(key) or 0)) if key else None
        return found[0] if found is not None else None

    async def _to_rank(self, message: dict, rank: int) -> dict:
        assert self.link is not None
        command, arguments = message["command"], dict(message.get("arguments") or {})
        for key in FRAME_KEYS:
            if arguments.get(key):
                arguments[key] = rank_of(int(arguments[key]))[1]  # type: ignore[index]  # a rank's: _rank_named said so
        if command == "pause" and rank not in self.link.stopped:
            self.link.tell_all(PanelNow(pause=True), only=rank)
            return _reply(message, {})
        try:
            answer = await asyncio.wait_for(asyncio.wrap_future(self.link.ask(rank, command, arguments)), ANSWER_SECONDS)
        except (LookupError, asyncio.TimeoutError) as exc:
            return _reply(message, None, str(exc) or f"rank {rank} did not answer within {ANSWER_SECONDS:.0f} s")
        if answer.error:
            return _reply(message, None, answer.error)
        if command == "copyToGlobals":  # over the rank's authenticated channel, as a cell's results come
            try:
                self.namespace[arguments["dstVariableName"]] = pickle.loads(answer.body["pickled"])  # noqa: S301 - authenticated
            except Exception as exc:  # noqa: BLE001 - a value the kernel cannot rebuild: said in the panel, never unanswered
                return _reply(message, None, f"could not copy it into the notebook: {type(exc).__name__}: {exc}")
            return _reply(message, {})
        return _reply(message, _unique(answer.body, rank))

    async def _set_breakpoints(self, message: dict) -> dict:
        arguments = message.get("arguments") or {}
        path = arguments.get("source", {}).get("path", "")
        marks = list(arguments.get("breakpoints") or [])
        if marks:
            self.breakpoints[path] = marks
        else:
            self.breakpoints.pop(path, None)
        if self.link is not None:
            self.link.tell_all(PanelNow(breakpoints=self._lines()))
        if path not in self.cells:
            return await self.original(message)
        shown = [{"verified": True, "line": mark["line"], "source": {"path": path}} for mark in marks]
        return _reply(message, {"breakpoints": shown})

    def _add_to_info(self, body: dict) -> None:
        known = {entry.get("source") for entry in body.get("breakpoints", [])}
        body.setdefault("breakpoints", []).extend(
            {"source": path, "breakpoints": marks} for path, marks in self.breakpoints.items() if path not in known)
        if self.link is not None:
            body.setdefault("stoppedThreads", []).extend(self.link.stopped_threads())

    def _disconnect(self) -> None:
        self.on = False
        self.breakpoints.clear()
        link = self.link
        if link is not None:
            link.tell_all(PanelNow(breakpoints=()))
            for rank in sorted(link.stopped):
                link.ask(rank, "disconnect", {})


def _is_taas_cell(code: str) -> bool:
    """A cell the input transformer routes to ``%%taas`` (cell/pragma.py's rule; a feature reads no stage)."""
    return any(PRAGMA.match(line) for line in code.splitlines())


def _unique(body: Any, rank: int) -> Any:
    """A rank's ids made the panel's: frames' ids and every ``variablesReference`` in the body."""
    if isinstance(body, list):
        return [_unique(each, rank) for each in body]
    if not isinstance(body, dict):
        return body
    unique = {key: _unique(value, rank) for key, value in body.items()}
    if "stackFrames" in unique:
        unique["stackFrames"] = [{**frame, "id": panel_id(rank, frame["id"])} for frame in unique["stackFrames"]]
    if isinstance(unique.get("variablesReference"), int):
        unique["variablesReference"] = panel_id(rank, unique["variablesReference"])
    return unique


def _reply(message: dict, body: dict | None, error: str = "") -> dict:
    reply = {"seq": 0, "type": "response", "request_seq": message.get("seq", 0), "success": not error,
             "command": message.get("command", "")}
    if error:
        reply["message"] = error
    else:
        reply["body"] = body
    return reply


class Publisher:
    """The panel's events sent on one thread of its own, in order. ipykernel gives each thread that publishes on IOPub
    a socket of its own, kept while the kernel lives: a run's thread is new each run, so each run would leave one."""

    def __init__(self, publish: Callable[[dict], None]):
        self._publish = publish
        self._events: queue.SimpleQueue[dict | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def put(self, event: dict) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="taas-panel-events", daemon=True)
                self._thread.start()
        self._events.put(event)

    def close(self) -> None:
        self._events.put(None)

    def _run(self) -> None:
        while (event := self._events.get()) is not None:
            try:
                self._publish(event)
            except Exception:  # noqa: BLE001 - a closed kernel's socket: the event has nowhere to go
                pass


def _ranks_not_under_debugpy() -> None:
    """debugpy, once the panel starts it in the kernel, starts every Python process the kernel starts under itself
    (its ``subProcess``, on by default): taas's spares and ranks then ran inside pydevd, slow and traced twice. Its
    public switch, read when it starts listening (JupyterLab's panel cannot show a child process's threads anyway)."""
    try:
        import debugpy

        debugpy.configure(subProcess=False)
    except Exception:  # noqa: BLE001 - a debugpy without the switch: the ranks are still debugged through the panel
        pass


_panel: Panel | None = None


def current() -> Panel | None:
    """This kernel's panel; None in a shell without ipykernel's debugger (a terminal IPython)."""
    return _panel


def install(shell: Any) -> Callable[[], None]:
    """The panel's requests answered here first (the kernel's ``do_debug_request``); returns what undoes it."""
    global _panel
    kernel = getattr(shell, "kernel", None)
    if kernel is None or getattr(kernel, "debugger", None) is None:
        return lambda: None
    _ranks_not_under_debugpy()
    publisher = Publisher(kernel._publish_debug_event)  # private API: see taas_magic/private.py
    _panel = Panel(kernel.do_debug_request, publisher.put, shell.user_ns)
    kernel.do_debug_request = _panel.request

    def undo() -> None:
        global _panel
        _panel = None
        publisher.close()
        if "do_debug_request" in vars(kernel):
            del kernel.do_debug_request

    return undo
