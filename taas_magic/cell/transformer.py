"""Route taas cells to the ``%%taas`` cell magic, before IPython compiles them.

Runs in the kernel, on its main thread, where IPython transforms a cell before compiling it.

This runs at the front of ``shell.input_transformers_cleanup``, in two pure, idempotent
steps (IPython calls ``transform_cell`` more than once on the same text) that never validate:

1. :func:`route_taas_cell`: any cell holding a ``#pragma taas`` line is handed whole to
   ``%%taas``, whose parser accepts it or raises a one-line ``UsageError``. So a pragma
   below code is an error rather than a comment that silently runs the cell locally. Every
   other cell passes through untouched.
2. :func:`await_taas_cell`, where the kernel runs cells as coroutines (IPython's
   ``autoawait`` with its asyncio runner, ipykernel's default): a ``%%taas ARGS`` cell
   becomes one ``await`` of the magic's coroutine with the same arguments. The run is then
   waited for with the kernel's event loop free, so the kernel answers the page meanwhile (a
   reloaded page restoring the run's live view, kernel/runs/foreground.py). Where it cannot, the
   cell stays ``%%taas`` and the magic waits blocking, as before.
"""

from __future__ import annotations

from typing import Callable

from taas_magic.cell.pragma import is_pragma_line

MAGIC_LINE = "%%taas\n"
MAGIC = "%%taas"
# The coroutine a taas cell awaits: the loaded extension's magic (taas_magic/__init__.py).
ENTRY = "__import__('taas_magic').run_cell"


def route_taas_cell(lines: list[str]) -> list[str]:
    """IPython cleanup transformer: ``lines`` keep their line endings."""
    first = next((line for line in lines if line.strip()), "")
    if first.lstrip().startswith("%%"):
        return lines  # already a cell magic (ours after a first pass, or someone else's)
    if not any(is_pragma_line(line) for line in lines):
        return lines
    return [MAGIC_LINE, *lines]


def await_taas_cell(lines: list[str]) -> list[str]:
    """A ``%%taas ARGS`` cell as one ``await`` of the magic's coroutine; anything else untouched."""
    index = next((i for i, line in enumerate(lines) if line.strip()), None)
    if index is None:
        return lines
    head = lines[index].strip()
    if head != MAGIC and not head.startswith(MAGIC + " "):
        return lines
    args, body = head[len(MAGIC):].strip(), "".join(lines[index + 1:])
    return [f"await {ENTRY}({args!r}, {body!r})\n"]


def taas_cells(can_await: Callable[[], bool]) -> Callable[[list[str]], list[str]]:
    """The transformer the extension installs: both steps, the second where ``can_await()``."""

    def transform(lines: list[str]) -> list[str]:
        routed = route_taas_cell(lines)
        return await_taas_cell(routed) if can_await() else routed

    transform.taas = True  # type: ignore[attr-defined]  # how unloading finds it
    return transform
