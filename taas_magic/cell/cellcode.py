"""The cell as the ranks run it: IPython syntax translated in the kernel, lines kept.

Runs in the kernel, on the cell's thread (and on a search's own thread for its trials:
kernel/trials/searchrun.py).

``!cmd`` and ``%magic`` are translated with the kernel's own IPython transformers
(minus ours, which would route the cell back to ``%%taas``), so they work in ranks.
IPython's transformers keep one output line per input line, so line ``k`` of the
translated code is line ``k`` of the cell as the person sees it, and a rank's
traceback can show the person's own text (registered in the rank's linecache).
"""

from __future__ import annotations

import ast
import functools
import linecache
from dataclasses import dataclass

from IPython.core.displayhook import DisplayHook
from IPython.core.inputtransformer2 import TransformerManager
from IPython.core.interactiveshell import InteractiveShell

from taas_magic.errors import TaasError


@dataclass(frozen=True)
class CellCode:
    display_source: str  # what the person wrote (head lines included)
    source: str  # plain Python, same line numbers
    tree: ast.Module
    filename: str
    suppress_final: bool  # the cell ends with ';', as IPython's displayhook honours


def _transformer_manager(shell: InteractiveShell) -> TransformerManager:
    manager = TransformerManager()
    own = shell.input_transformer_manager
    manager.cleanup_transforms = [t for t in own.cleanup_transforms if not getattr(t, "taas", False)]
    manager.line_transforms = list(own.line_transforms)
    manager.token_transformers = list(own.token_transformers)
    return manager


def translate(shell: InteractiveShell, display_source: str) -> CellCode:
    """Translate the cell's IPython syntax to Python and parse it.

    Raises:
        TaasError: the cell has a syntax error (reported with the person's line number).
    """
    filename = f"<taas In[{running_cell_number(shell)}]>"
    manager = _transformer_manager(shell)
    tree = _plain_python(manager, display_source, filename)
    source = display_source
    if tree is None:
        source = manager.transform_cell(display_source)
    for transform in shell.input_transformers_post:
        source = "".join(transform(source.splitlines(keepends=True)))
    try:
        if tree is None or source != display_source:
            tree = ast.parse(source, filename=filename)
    except SyntaxError as exc:
        line = (exc.text or "").strip()
        raise TaasError(f"taas: SyntaxError on line {exc.lineno} of the cell: {exc.msg}: {line!r}") from None
    # private API (DisplayHook.semicolon_at_end_of_expression): see taas_magic/private.py
    return CellCode(display_source, source, tree, filename, DisplayHook.semicolon_at_end_of_expression(source))


@functools.cache
def _ipython_own() -> TransformerManager:
    """IPython's own transforms, as a new shell has them."""
    return TransformerManager()


def _plain_python(manager: TransformerManager, source: str, filename: str) -> ast.Module | None:
    """The cell's tree where IPython's transforms would leave it as it is, else None (translate it).

    IPython's own transforms change only what is not Python (``%``, ``!``, ``?``, prompts, a leading
    indent), and a leading blank line, so a cell that parses as it stands and begins with code is its own
    translation: IPython's tokenizing pass over it (the longest step of a kept cell's plan, longer with
    every line) is skipped. Only with exactly IPython's transforms: an extension's own may change Python."""
    default = _ipython_own()
    if (manager.cleanup_transforms != default.cleanup_transforms or manager.line_transforms != default.line_transforms
            or manager.token_transformers != default.token_transformers):
        return None
    first = source.split("\n", 1)[0]
    if not first.strip():
        return None
    try:
        return ast.parse(source, filename=filename)
    except SyntaxError:
        return None


def running_cell_number(shell: InteractiveShell) -> int:
    """The number the frontend shows for the cell that runs now (``In [N]``). IPython stores a cell's
    input under its number before running it; since IPython 8.x ``execution_count`` is already the
    next cell's while one runs (9.18: one more than the reply's), so it is read from the history."""
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    if history:
        return len(history) - 1
    return shell.execution_count


def earlier_cells(shell: InteractiveShell, pickled: bytes) -> dict[str, tuple[int, list[str]]]:
    """The notebook cells whose code the pickle carries: file name -> (execution count, lines).

    A function defined in ``In[3]`` keeps that cell's file name as its code's filename;
    the ranks register these lines in their linecache and label the frames
    ``Cell In[3], line 2``, as IPython does, so a rank's traceback shows the person's lines.
    """
    cells = {}
    # private API (IPython's _filename_map, linecache.cache): see taas_magic/private.py
    for filename, number in getattr(shell.compile, "_filename_map", {}).items():
        entry = linecache.cache.get(filename)
        if entry is not None and len(entry) == 4 and filename.encode() in pickled:  # 4: loaded, not lazy
            cells[filename] = (number, list(entry[2]))
    return cells
