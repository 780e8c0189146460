"""The kernel **Python 3 (taas)** loads the extension through this module (its kernel.json says
``--ext=taas_magic.kernel.magic.preload``), not as ``taas_magic`` itself.

Why: IPython's extension manager remembers the module names it loaded, and a notebook that was
written for any kernel starts with ``%load_ext taas_magic``. Had the kernel loaded ``taas_magic``
by that name, the cell would print IPython's "The taas_magic extension is already loaded". Loaded
under this name, ``%load_ext taas_magic`` calls :func:`taas_magic.load_ipython_extension` once more,
which does nothing (and says nothing) for a shell it already serves. Runs on the kernel's main
thread, at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import taas_magic

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell


def load_ipython_extension(ipython: InteractiveShell) -> None:
    taas_magic.load_ipython_extension(ipython)


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    taas_magic.unload_ipython_extension(ipython)
