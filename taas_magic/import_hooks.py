"""Imports with consequences: a callback run right after a module is first imported in the
rank, and a first import made on a stack of its own in the kernel.

Runs in each rank (:func:`when_imported`, installed on its main thread by rank/main.py and the write
rule's modules; a callback runs on whichever thread first imports its module) and in the kernel
(:func:`import_on_own_stack`, called from the cell's or a search's thread, importing on a
short-lived helper thread).

:func:`when_imported` pays only for what a cell uses: the non-interactive IPython shell is
built when the cell (or matplotlib's inline backend) imports IPython, and ``nccl`` is mapped
to ``gloo`` when ``torch.distributed`` is imported on a host without GPUs.

:func:`import_on_own_stack` imports a heavy optional module (Optuna, the live widget's
anywidget) for the first time on a short-lived thread. Some libraries keep an exception from
their import for later (Optuna's ``try_import`` keeps every optional dependency's
ImportError): its traceback's frames reach, through ``f_back``, every frame that was running
the import. Imported from the magic's stack, that would pin the frames that hold a cell's
closure and its run, so a tensor the notebook deletes would never be freed
(tests/kernel/test_memory.py). A thread's stack ends at the thread.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Sequence


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[ModuleType], None]):
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback(module)

    def __getattr__(self, name: str) -> Any:  # get_data, is_package, ... for importlib.resources & co
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self.callbacks: dict[str, Callable[[ModuleType], None]] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        callback = self.callbacks.pop(fullname, None)
        if callback is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _CallbackLoader(spec.loader, callback)
                return spec
        return None


_finder = _PostImportFinder()


def when_imported(name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    earlier = _finder.callbacks.get(name)
    _finder.callbacks[name] = callback if earlier is None else _both(earlier, callback)


def _both(first: Callable[[ModuleType], None], then: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    def both(module: ModuleType) -> None:
        first(module)
        then(module)

    return both


def import_on_own_stack(name: str) -> ModuleType:
    """``importlib.import_module(name)``, the first time on a thread of its own (see the module docstring);
    its error, if any, is raised here."""
    module = sys.modules.get(name)
    if module is not None:
        return module
    done: list[ModuleType | BaseException] = []

    def load() -> None:
        try:
            done.append(importlib.import_module(name))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            done.append(exc.with_traceback(None))

    thread = threading.Thread(target=load, name=f"taas-import-{name}", daemon=True)
    thread.start()
    thread.join()
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]
