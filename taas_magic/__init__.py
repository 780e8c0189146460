"""taas_magic: ``#pragma taas --gpus N`` runs a notebook cell as N DDP ranks.

``%load_ext taas_magic`` registers the ``%%taas``/``%taas`` magics and the input
transformer that routes ``#pragma taas`` cells to ``%%taas``; ``%unload_ext taas_magic``
removes all of it. This module imports nothing heavy: ranks import the package too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__version__ = "0.1.0"

_loaded: dict[str, Any] = {}


def load_ipython_extension(ipython: InteractiveShell) -> None:
    from taas_magic.cell.transformer import route_taas_cell
    from taas_magic.kernel.magics import TaasMagics

    if _loaded.get("shell") is ipython:
        return
    magics = TaasMagics(shell=ipython)
    ipython.register_magics(magics)
    ipython.input_transformers_cleanup.insert(0, route_taas_cell)
    _loaded.update(shell=ipython, magics=magics)


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    from taas_magic.cell.transformer import route_taas_cell

    magics = _loaded.get("magics")
    if magics is not None:
        magics.spares.close()
    # IPython has no API to unregister magics: remove our entries, as alias.py does.
    manager = ipython.magics_manager
    for kind in ("line", "cell"):
        if getattr(manager.magics[kind].get("taas"), "__self__", None) is _loaded.get("magics"):
            del manager.magics[kind]["taas"]
    manager.registry.pop("TaasMagics", None)
    while route_taas_cell in ipython.input_transformers_cleanup:
        ipython.input_transformers_cleanup.remove(route_taas_cell)
    _loaded.clear()
