"""A taas cell prepared to run: its settings, its Python, the notebook names it reads. One path for both faces.

Runs in the kernel, on the cell's thread: the magic prepares each cell it runs (kernel/magic/magics.py), and
``%taas export`` the cell it writes as a job (export/command.py), the same way, so a job is the cell a run would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from IPython.core.interactiveshell import InteractiveShell

from taas_magic.cell.cellcode import CellCode, translate
from taas_magic.cell.closure import select_closure
from taas_magic.cell.pragma import PragmaOptions, RunSettings, parse_cell, settle
from taas_magic.launch.rankenv import RankChoice


@dataclass(frozen=True)
class PreparedCell:
    settings: RunSettings  # the pragma over the session's defaults, ``--gpus auto`` made a number
    why: str | None  # why that many ranks (``--gpus auto``), for the run's header
    code: CellCode  # the cell as Python, the person's line numbers kept
    closure: dict[str, Any]  # the notebook names it reads, by name


def prepare(shell: InteractiveShell, cell: str, line: str | None, defaults: Mapping[str, object],
            choose: Callable[[PragmaOptions], RankChoice]) -> PreparedCell:
    """``cell`` (below a ``%%taas LINE``, or with its ``#pragma taas`` head) parsed, settled against ``defaults`` with
    ``choose``'s number of ranks (this host's GPUs, or a cluster's), translated as IPython runs it, its closure
    chosen from the shell's namespace.

    Raises:
        PragmaError: the head or its options are malformed; whatever ``choose`` raises (a refusal, one line).
    """
    parsed = parse_cell(cell, line)
    choice = choose(parsed.options)
    settings = settle(parsed.options, defaults, choice.ranks)
    code = translate(shell, parsed.source)
    return PreparedCell(settings, choice.why, code, select_closure(code.tree, shell.user_ns, shell.user_ns_hidden))
