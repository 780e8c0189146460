"""Route taas cells to the ``%%taas`` cell magic, before IPython compiles them.

This runs at the front of ``shell.input_transformers_cleanup``. It is pure and
idempotent (IPython calls ``transform_cell`` more than once on the same text) and
never validates: any cell holding a ``#pragma taas`` line is handed whole to
``%%taas``, whose parser accepts it or raises a one-line ``UsageError``. So a pragma
below code is an error rather than a comment that silently runs the cell locally.
Every other cell passes through untouched.
"""

from __future__ import annotations

from taas_magic.cell.pragma import is_pragma_line

MAGIC_LINE = "%%taas\n"


def route_taas_cell(lines: list[str]) -> list[str]:
    """IPython cleanup transformer: ``lines`` keep their line endings."""
    first = next((line for line in lines if line.strip()), "")
    if first.lstrip().startswith("%%"):
        return lines  # already a cell magic (ours after a first pass, or someone else's)
    if not any(is_pragma_line(line) for line in lines):
        return lines
    return [MAGIC_LINE, *lines]
