"""A non-interactive IPython shell for the rank, built only when the cell needs one.

Runs in each rank, on the cell's thread, built on its first use.

``!cmd``, ``%time`` and friends arrive in the rank as ``get_ipython().system(...)``
and ``get_ipython().run_line_magic(...)`` (translated in the kernel with IPython's own
transformers). ``display(...)`` and matplotlib's inline backend need an initialised
InteractiveShell too. This shell:

- publishes rich output to the kernel over the authenticated channel (rank 0, or every
  rank with ``--output all``), then writes a marker to fd 1 so the kernel shows it at
  exactly its place among the rank's text (see relay.py);
- keeps no history file (eight ranks would fight over ``history.sqlite``);
- does not look interactive: IPython sets ``sys.ps1``, which makes Lightning refuse
  ``strategy="ddp"``; it is removed again at once.
"""

from __future__ import annotations

import itertools
import os
import sys
from types import ModuleType
from typing import Any, Callable

from taas_magic.output.relay import ClearOutput, Display, display_marker

Forward = Callable[[Display | ClearOutput], None]

_state: dict[str, Any] = {"shell": None, "module": None, "forward": None}
_numbers = itertools.count()


def configure(module: ModuleType, forward: Forward | None) -> None:
    """Set the cell's module and where display messages go (None: drop them)."""
    _state["module"], _state["forward"] = module, forward


def _forward(frame: Callable[[int], Display | ClearOutput]) -> None:
    """Send the display ``frame(number)`` makes, then its marker on fd 1 (after the text before it)."""
    sys.stdout.flush()
    sys.stderr.flush()
    forward = _state["forward"]
    if forward is None:
        return
    number = next(_numbers)
    forward(frame(number))
    os.write(1, display_marker(number))


def get_shell() -> Any:
    """The rank's InteractiveShell, created on first use."""
    if _state["shell"] is not None:
        return _state["shell"]
    from IPython.core.displaypub import DisplayPublisher
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    class ForwardingDisplayPublisher(DisplayPublisher):
        def publish(self, data: dict[str, Any], metadata: dict[str, Any] | None = None, source: object = None, *,
                    transient: dict[str, Any] | None = None, update: bool = False, **kwargs: Any) -> None:
            _forward(lambda number: Display(data, metadata or {}, transient or {}, update, number))

        def clear_output(self, wait: bool = False) -> None:
            _forward(lambda number: ClearOutput(wait, number))

    config = Config()
    config.HistoryManager.enabled = False
    shell = InteractiveShell.instance(
        config=config,
        user_module=_state["module"],
        display_pub_class=ForwardingDisplayPublisher,
    )
    for name in ("ps1", "ps2", "ps3"):
        sys.__dict__.pop(name, None)
    _state["shell"] = shell
    return shell


def hidden_names() -> set[str]:
    """Names the shell put into the cell's namespace for itself."""
    shell = _state["shell"]
    return set(shell.user_ns_hidden) if shell is not None else set()


def user_names(namespace: dict) -> list[str]:
    """The names a rank's cells bound in ``namespace``, sorted: not private, not the shell's own."""
    hidden = hidden_names() | {"get_ipython"}
    return sorted(name for name in namespace if not name.startswith("_") and name not in hidden)


def after_cell() -> None:
    """What IPython does after a cell: matplotlib's inline backend shows open figures."""
    shell = _state["shell"]
    if shell is not None:
        shell.events.trigger("post_execute")
        shell.events.trigger("post_run_cell", None)


def get_ipython() -> Any:
    """Stand-in placed in the cell's namespace: builds the shell on the first call."""
    return get_shell()


def on_ipython_import(_module: ModuleType) -> None:
    get_shell()
