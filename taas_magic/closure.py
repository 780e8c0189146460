"""Which notebook names a cell uses, and shipping exactly those to the ranks.

The cell's closure is the notebook names it may read before binding them (freenames.py:
a name the cell assigns before any use, as a rerun cell does with ``model = Net()``, is
not shipped), plus identifiers inside the string arguments of ``get_ipython()`` calls,
which is how IPython spells ``!cmd $x`` and ``%time f(x)`` after translation. Names
IPython keeps for itself (``In``, ``Out``, ``_``, ``_i3``...) and dunders are never
shipped. A name the cell does not read is never pickled, however large.

What is shipped is one dict, serialised once with cloudpickle (protocol 5): notebook
functions, classes and lambdas travel by value with what they reference; importable
modules and library objects travel by reference and are re-imported in the ranks.

Loaders registered with ``taas.register`` are *externals*: wherever the closure reaches
one (a name, a dict of loaders, a function's default), it is pickled as a reference
``("taas-feed", i)`` that the rank resolves to its prepared loader (feed/proxy.py).
Which externals were reached is how the kernel knows which loaders the cell uses.
"""

from __future__ import annotations

import ast
import io
import re
from typing import Any, Mapping, Sequence

import cloudpickle

from .errors import ClosureError
from .freenames import free_names

_IPYTHON_PRIVATE = re.compile(r"^_+$|^_i+$|^_i?\d+$|^__.*__$")


def select_closure(tree: ast.Module, user_ns: Mapping[str, Any], hidden: Mapping[str, Any]) -> dict[str, Any]:
    """The notebook names the cell may read before binding them, mapped to their values."""
    return {
        name: user_ns[name]
        for name in sorted(free_names(tree))
        if name in user_ns
        and not _IPYTHON_PRIVATE.match(name)
        and not (name in hidden and hidden[name] is user_ns[name])
    }


def _type_name(value: Any) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


class _ClosurePickler(cloudpickle.Pickler):
    def __init__(self, file: io.BytesIO, externals: Sequence[Any]):
        super().__init__(file, protocol=5)
        self._externals = {id(obj): index for index, obj in enumerate(externals)}
        self.used: set[int] = set()

    def persistent_id(self, obj: Any):
        index = self._externals.get(id(obj))
        if index is None:
            return None
        self.used.add(index)
        return ("taas-feed", index)


def _dumps(value: Any, externals: Sequence[Any]) -> tuple[bytes, set[int]]:
    if not externals:
        return cloudpickle.dumps(value, protocol=5), set()
    buffer = io.BytesIO()
    pickler = _ClosurePickler(buffer, externals)
    pickler.dump(value)
    return buffer.getvalue(), pickler.used


def serialise_closure(closure: Mapping[str, Any], externals: Sequence[Any] = ()) -> tuple[bytes, list[int]]:
    """Pickle the closure once; return it and the indices of the externals it reached.

    Raises:
        ClosureError: with the variable's name, type and pickle's reason.
    """
    try:
        blob, used = _dumps(dict(closure), externals)
        return blob, sorted(used)
    except Exception as whole_error:  # noqa: BLE001 - pickling can fail with any exception type
        for name, value in closure.items():
            try:
                _dumps(value, externals)
            except Exception as exc:  # noqa: BLE001
                raise ClosureError(name, _type_name(value), f"{type(exc).__name__}: {exc}") from None
        # Each value pickles alone but not together (e.g. a shared object's state differs).
        raise ClosureError(
            ", ".join(closure), "closure", f"{type(whole_error).__name__}: {whole_error}"
        ) from None
