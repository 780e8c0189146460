"""What ``taas`` calls in the notebook read from the loaded extension's session.

Runs wherever ``taas`` calls it: in the kernel, on the cell's thread, and in a rank, where it finds
no session.

- ``taas.wait()``, ``taas.trials()``, ``taas.study()``: the handlers of ``%taas wait``, ``%taas
  trials`` and ``%taas study`` (kernel/magic/commands.py), called with their typed arguments on
  the loaded magic's session and settings: what the line does, without a line to parse;
- ``taas.metrics()`` and, in the notebook, ``taas.load_checkpoint()`` / ``taas.checkpoint_path()``:
  the session's last run (kernel/runs/summary.py's LastRun), its one owner: nothing process-wide.

This module imports nothing at load (IPython and the commands when called): ``import taas``
imports it, in a rank too, where there is no session (no metrics, and the rank's own checkpoint
folder is used).
"""

from __future__ import annotations

import sys
from typing import Any


def _magic(call: str) -> Any:
    """The loaded extension's magic (kernel/magic/magics.py's TaasMagics): the one ``%taas`` is bound to.

    Raises:
        RuntimeError: outside an IPython kernel with the taas_magic extension loaded.
    """
    from IPython import get_ipython

    shell = get_ipython()
    line = None if shell is None else shell.find_line_magic("taas")
    if line is None:
        raise RuntimeError(f"taas.{call}(): the taas_magic extension is not loaded here (%load_ext taas_magic)")
    return line.__self__


def shell() -> Any:
    """The IPython shell this code runs in, or None (a script, a rank): IPython is not imported for the asking."""
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def wait(run: str | None) -> Any:
    """``%taas wait [RUN]``'s handler (kernel/magic/commands.py), given the run as the caller named it."""
    from taas_magic.kernel.magic import commands

    magic = _magic("wait")
    return commands.wait(magic.session, magic.command_settings(), run)


def trials() -> Any:
    """``%taas trials``'s handler."""
    from taas_magic.kernel.magic import commands

    magic = _magic("trials")
    return commands.trials(magic.session, magic.command_settings())


def study() -> Any:
    """``%taas study``'s handler."""
    from taas_magic.kernel.magic import commands

    magic = _magic("study")
    return commands.study(magic.session, magic.command_settings())


def _last_run() -> Any:
    """The loaded extension's session's last run (kernel/runs/summary.py's LastRun), None without one: the magic
    this process's shell registered (IPython's registry of magics, by class name)."""
    ipython = sys.modules.get("IPython")  # not imported by this call: a rank's import builds its shell (rank/shell.py)
    shell = ipython.get_ipython() if ipython is not None else None
    magics = None if shell is None else shell.magics_manager.registry.get("TaasMagics")
    session = getattr(magics, "session", None)
    return None if session is None else session.last_run


def last_metrics() -> list[dict]:
    """The last run's rank-0 reports (a copy: the person may change it), ``[]`` before any run or outside a kernel."""
    last = _last_run()
    return [dict(item) for item in last.metrics] if last is not None else []


def last_checkpoints() -> str | None:
    """The last run's checkpoint folder, None before any run or outside a kernel."""
    last = _last_run()
    return (last.checkpoints or None) if last is not None else None
