"""taas_magic: ``#pragma taas --gpus N`` runs a notebook cell as N DDP ranks.

``%load_ext taas_magic`` registers the ``%%taas``/``%taas`` magics and the input
transformer that routes ``#pragma taas`` cells to ``%%taas``; ``%unload_ext taas_magic``
removes all of it. This module imports nothing heavy: ranks import the package too.

The kernel **Python 3 (taas)** calls :func:`load_ipython_extension` from its start-up lines
(jupyter-config/kernels/taas/kernel.json), not as ``--ext=taas_magic``: IPython's extension
manager would then remember the name, and a notebook's own first cell, ``%load_ext taas_magic``,
would print "already loaded". Called again for a shell it serves, it does nothing, silently.

The package, in the order a cell flows through it (docs/architecture.md), the stages:

- ``cell/``: the cell's text -> Python with its line numbers, its options, its closure; pure.
- ``kernel/``: ``%%taas`` planned, started, supervised and drawn, in four rooms from the face down.
- ``export/``: the other face: ``%taas export`` writes a cell as a job that runs without Jupyter; its runtime.
- ``launch/``: where the ranks and data workers run and how they start, by engine (local, Ray, Slurm).
- ``feed/``: data workers: registered loaders prepared by CPU processes while the ranks train.
- ``rank/``: the child runtime: what runs inside a rank, a warm spare and the spare factory.

The features, each a kernel half and a rank half:

- ``transfer/``: values across the process boundary, both ways: the closure out, rank 0's names back.
- ``output/``: what the ranks show: their text within a budget, rich output, the live chart, the run log.
- ``autopsy/``: why a run hangs: every rank's stacks, dumped and summarised.
- ``writes/``: only rank 0 writes to the repository (but collective checkpoints); taas's checkpoints.
- ``search/``: many trials from one cell: the study, the grid, each trial's two halves.
- ``compilecache/``: the session's torch.compile caches: one owner-only folder, and each rank's artifacts.
- ``profiling/``: ``--profile``: each rank's bounded window recorded, the traces merged, each rank's time split.
- ``debugger/``: JupyterLab's debugger panel on the ranks: the panel's requests multiplexed, each rank a thread.

The ground, which every package may import and which imports only itself (at most 10 modules):

- ``wire.py``: the authenticated hello (one pair for every listener) and HMAC-signed frames.
- ``protocol.py``: every frame as a frozen dataclass with its direction, dispatched by type.
- ``runspec.py``: ``RunSpec``, the frozen value every rank receives; the registered loaders' plans.
- ``peers.py``: ranks and data workers numbered on the wire in one place; the output hub's channels.
- ``errors.py``: the error tree; each error renders itself as the cell's error.
- ``procs.py``: the INT -> TERM -> KILL ladder, written once; ending what carries a run's owner tag.
- ``tempdirs.py``: where temporary files live, and how they are removed and swept.
- ``import_hooks.py``: a callback on a module's first import; a first import on a stack of its own.
- ``history.py``: ``SeriesHistory``, a bounded series, kept by both the output and the search.
- ``private.py``: every private API of another package taas calls, with the versions checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__version__ = "0.1.0"

_loaded: dict[str, Any] = {}


def load_ipython_extension(ipython: InteractiveShell) -> None:
    from taas_magic.cell.transformer import taas_cells
    from taas_magic.debugger import panel
    from taas_magic.kernel.magic.debug import wrap_ipython_debug
    from taas_magic.kernel.magic.magics import TaasMagics

    if _loaded.get("shell") is ipython:
        return
    magics = TaasMagics(shell=ipython)
    ipython.register_magics(magics)
    ipython.input_transformers_cleanup.insert(0, taas_cells(lambda: _runs_coroutines(ipython)))
    _loaded.update(shell=ipython, magics=magics, put_back_debug=wrap_ipython_debug(ipython),
                   put_back_panel=panel.install(ipython))  # JupyterLab's debugger panel on the ranks


def _runs_coroutines(ipython: InteractiveShell) -> bool:
    """The shell awaits a cell's top-level ``await`` on asyncio (IPython's autoawait; ipykernel's default)."""
    from IPython.core.async_helpers import _asyncio_runner  # private API: see taas_magic/private.py

    return bool(getattr(ipython, "autoawait", False)) and getattr(ipython, "loop_runner", None) is _asyncio_runner


async def run_cell(line: str, cell: str) -> object:
    """What a taas cell awaits (cell/transformer.py): the loaded magic's coroutine."""
    magics = _loaded.get("magics")
    if magics is None:
        raise RuntimeError("taas: the taas_magic extension is not loaded here (%load_ext taas_magic)")
    return await magics.taas_cell_async(line, cell)


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    magics = _loaded.get("magics")
    if magics is not None:
        magics.close()
    for put_back in (_loaded.get("put_back_debug"), _loaded.get("put_back_panel")):
        if put_back is not None:
            put_back()
    # IPython has no API to unregister magics: remove our entries, as alias.py does (private API: see taas_magic/private.py).
    manager = ipython.magics_manager
    for kind in ("line", "cell"):
        if getattr(manager.magics[kind].get("taas"), "__self__", None) is _loaded.get("magics"):
            del manager.magics[kind]["taas"]
    manager.registry.pop("TaasMagics", None)
    ipython.input_transformers_cleanup[:] = [transform for transform in ipython.input_transformers_cleanup
                                             if not getattr(transform, "taas", False)]
    _loaded.clear()
