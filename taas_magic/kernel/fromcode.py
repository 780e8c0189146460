"""The ``%taas`` line commands a cell calls as functions: ``taas.wait()``, ``taas.trials()``, ``taas.study()``.

Each runs the loaded magic's line command in the notebook's shell, exactly as ``%taas wait``,
``%taas trials`` and ``%taas study`` do (kernel/runcommands.py, kernel/commands.py). This module
imports nothing at load (IPython when called): ``import taas`` imports it, in a rank too.
"""

from __future__ import annotations

from typing import Any


def line_command(command: str, argument: str = "") -> Any:
    """``%taas COMMAND [ARGUMENT]``'s value, run in this kernel's shell.

    Raises:
        RuntimeError: outside an IPython kernel with the taas_magic extension loaded.
    """
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None or shell.find_line_magic("taas") is None:
        raise RuntimeError(f"taas.{command}(): the taas_magic extension is not loaded here (%load_ext taas_magic)")
    return shell.run_line_magic("taas", f"{command} {argument}" if argument else command)
