"""What a stopped rank answers the panel about its stack: frames, scopes, variables, evaluate.

Runs in each rank, on the cell's thread, while it is stopped (debugger/tracer.py); nothing here runs
while the rank runs.

The answers are DAP bodies (the Debug Adapter Protocol's ``stackTrace``, ``scopes``, ``variables``,
``evaluate``, ``richInspectVariables``, ``copyToGlobals``), with the rank's own ids: a frame is its place in the stack
(1 the innermost), a variable container a number handed out at this stop. The kernel
(debugger/ranklink.py) makes both unique among the ranks before the panel sees them. Every id is
forgotten when the rank resumes: the panel asks again at the next stop, as it does of debugpy.

A cell's frames name the file the panel knows the cell by (ipykernel's cell file, ``panel_path``),
so the panel shows its own cell; a repr that raises is shown as the error, never raised.
"""

from __future__ import annotations

import reprlib
from types import FrameType
from typing import Any

CHILDREN_MOST = 300  # a container's first children shown
_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict = 200, 200, 20, 20


def _repr(value: Any) -> str:
    try:
        return _REPR.repr(value)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ is the person's: shown, not raised
        return f"<repr raised {type(exc).__name__}: {exc}>"


def _children(value: Any) -> list[tuple[str, Any]]:
    """The named parts the panel can open: a dict's items, a sequence's elements, an object's attributes."""
    if isinstance(value, dict):
        return [(key if isinstance(key, str) else _repr(key), item) for key, item in list(value.items())[:CHILDREN_MOST]]
    if isinstance(value, (list, tuple)):
        return [(str(index), item) for index, item in enumerate(value[:CHILDREN_MOST])]
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict) and not isinstance(value, type):
        return list(attributes.items())[:CHILDREN_MOST]
    return []


class FrameView:
    """One stop's stack (innermost first) and the containers handed out while it lasts."""

    def __init__(self, frames: list[FrameType], cell_file: str, panel_path: str):
        self.frames, self.cell_file, self.panel_path = frames, cell_file, panel_path
        self._containers: dict[int, Any] = {}

    def _source(self, frame: FrameType) -> dict:
        filename = frame.f_code.co_filename
        if filename == self.cell_file and self.panel_path:
            return {"path": self.panel_path, "name": filename}
        return {"path": filename, "name": filename.rsplit("/", 1)[-1]}

    def stack_trace(self, arguments: dict) -> dict:
        first = int(arguments.get("startFrame", 0))
        count = int(arguments.get("levels", 0)) or len(self.frames)
        shown = [{"id": index + 1, "name": frame.f_code.co_name, "line": frame.f_lineno, "column": 1,
                  "source": self._source(frame)}
                 for index, frame in enumerate(self.frames)][first:first + count]
        return {"stackFrames": shown, "totalFrames": len(self.frames)}

    def frame(self, frame_id: int) -> FrameType:
        if not 1 <= frame_id <= len(self.frames):
            raise LookupError(f"no frame {frame_id} in this rank's stack")
        return self.frames[frame_id - 1]

    def _hand_out(self, value: Any) -> int:
        reference = len(self._containers) + 1
        self._containers[reference] = value
        return reference

    def scopes(self, arguments: dict) -> dict:
        frame = self.frame(int(arguments["frameId"]))
        scopes = [{"name": "Locals", "variablesReference": self._hand_out(frame.f_locals), "expensive": False}]
        if frame.f_locals is not frame.f_globals:
            scopes.append({"name": "Globals", "variablesReference": self._hand_out(frame.f_globals), "expensive": False})
        return {"scopes": scopes}

    def _variable(self, name: str, value: Any) -> dict:
        openable = bool(_children(value))
        return {"name": name, "value": _repr(value), "type": type(value).__name__,
                "evaluateName": name, "variablesReference": self._hand_out(value) if openable else 0}

    def variables(self, arguments: dict) -> dict:
        reference = int(arguments["variablesReference"])
        if reference not in self._containers:
            raise LookupError(f"no variables {reference} at this stop")
        shown = [(name, value) for name, value in _children(self._containers[reference])
                 if not (name.startswith("__") and name.endswith("__"))]
        return {"variables": [self._variable(name, value) for name, value in shown]}

    def evaluate(self, arguments: dict) -> dict:
        """``expression`` in the frame (the innermost without ``frameId``): an expression's value, or a
        statement run (the panel's console), as debugpy's ``evaluate`` does."""
        frame = self.frame(int(arguments.get("frameId") or 1))
        expression = arguments["expression"]
        try:
            code = compile(expression, "<debug console>", "eval")
        except SyntaxError:
            exec(compile(expression, "<debug console>", "exec"), frame.f_globals, frame.f_locals)  # noqa: S102 - the person's own line
            return {"result": "", "variablesReference": 0}
        value = eval(code, frame.f_globals, frame.f_locals)  # noqa: S307 - the person's own expression
        return {"result": _repr(value), "type": type(value).__name__,
                "variablesReference": self._hand_out(value) if _children(value) else 0}

    def copy(self, arguments: dict) -> dict:
        """JupyterLab's *Copy to Globals*: the variable's value, pickled, for the kernel to bind in the notebook (it
        goes over the rank's authenticated channel, as a cell's results do)."""
        import cloudpickle

        frame = self.frame(int(arguments.get("srcFrameId") or 1))
        value = eval(arguments["srcVariableName"], frame.f_globals, frame.f_locals)  # noqa: S307 - a name the panel shows
        if getattr(value, "is_cuda", False):
            value = value.cpu()  # a GPU tensor comes to the notebook on the CPU (the kernel's GPU 0 is not the rank's)
        return {"pickled": cloudpickle.dumps(value)}

    def rich_inspect(self, arguments: dict) -> dict:
        """JupyterLab's variable viewer: the value as text (a rank has no display formatter of the notebook's)."""
        frame = self.frame(int(arguments.get("frameId") or 1))
        value = eval(arguments["variableName"], frame.f_globals, frame.f_locals)  # noqa: S307 - a name the panel shows
        return {"data": {"text/plain": _repr(value)}, "metadata": {}}
