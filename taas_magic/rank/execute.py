"""Run the cell's code as a module's body, the way IPython would, but not interactively.

Runs in each rank, on its main thread, which runs the cell.

The last expression statement is split off and evaluated, so it can become the cell's
``Out``. The person's cell text is registered in ``linecache`` under the cell's file
name (as IPython's compilerop does), so a traceback shows the cell's own lines with
the person's line numbers; our frames are stripped from it.
"""

from __future__ import annotations

import ast
import linecache
import re
import traceback
from types import ModuleType
from typing import Any

NO_VALUE = object()
_CELL_FILE = re.compile(r"<taas In\[(\d+)\]>")  # the running cell's file name (cellcode.py)
_FILE_LINE = re.compile(r'File "([^"]+)", line ')  # a traceback's place
_CELL_LABELS: dict[str, str] = {}  # an earlier notebook cell's file name -> "Cell In[3]"


# linecache.cache entries, made as linecache and IPython's compiler make them (private API: see taas_magic/private.py)
def register_source(filename: str, display_source: str) -> None:
    lines = display_source.splitlines(keepends=True)
    linecache.cache[filename] = (len(display_source), None, lines, filename)


def register_cells(cells: dict[str, tuple[int, list[str]]]) -> None:
    """Earlier notebook cells (cellcode.earlier_cells): their lines, and their IPython labels."""
    for filename, (number, lines) in cells.items():
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
        _CELL_LABELS[filename] = f"Cell In[{number}]"


def cell_label(filename: str) -> str:
    """``Cell In[5]`` for the notebook's cells (the running one and earlier ones), as IPython names them;
    any other file as it is."""
    found = _CELL_FILE.fullmatch(filename)
    if found:
        return f"Cell In[{found.group(1)}]"
    return _CELL_LABELS.get(filename, filename)


def run_cell(source: str, filename: str, module: ModuleType) -> Any:
    """Execute ``source`` in ``module``; return its last expression's value or NO_VALUE."""
    tree = ast.parse(source, filename=filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        final_statement = tree.body.pop()
        assert isinstance(final_statement, ast.Expr)
        last = ast.Expression(final_statement.value)
    namespace = module.__dict__
    exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - running the person's cell is the point
    if last is None:
        return NO_VALUE
    return eval(compile(last, filename, "eval"), namespace)  # noqa: S307 - the cell's own last expression


def format_cell_traceback(exc: BaseException, filename: str) -> str:
    """The traceback from the first frame of the cell down, like a local error's."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    if tb is None:
        tb = exc.__traceback__
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return _FILE_LINE.sub(_label_place, text)


def _label_place(place: re.Match) -> str:
    label = cell_label(place.group(1))
    return place.group(0) if label == place.group(1) else f"{label}, line "


def signature(exc: BaseException, filename: str) -> tuple[str, str, int] | None:
    """The exception's type and its innermost frame in the notebook's code (this cell, or an
    earlier cell's function): the same in two attempts means a deterministic bug (restarts.py)."""
    notebook = {filename, *_CELL_LABELS}
    where = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in notebook:
            where = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    if where is None:
        return None
    return (type(exc).__qualname__, *where)
