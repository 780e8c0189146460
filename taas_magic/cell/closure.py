"""Which notebook names a cell uses, and shipping exactly those to the ranks.

Runs in the kernel, on the cell's thread, as the magic plans the run.

The cell's closure is the notebook names it may read before binding them (freenames.py:
a name the cell assigns before any use, as a rerun cell does with ``model = Net()``, is
not shipped), plus identifiers inside the string arguments of ``get_ipython()`` calls,
which is how IPython spells ``!cmd $x`` and ``%time f(x)`` after translation. Names
IPython keeps for itself (``In``, ``Out``, ``_``, ``_i3``...) and dunders are never
shipped. A name the cell does not read is never pickled, however large.

What is shipped is pickled once with cloudpickle (protocol 5), name by name in one
stream (transfer/pack.py): notebook functions, classes and lambdas travel by value with
what they reference; importable modules and library objects travel by reference and
are re-imported in the ranks; tensor and array bytes travel beside the pickle, never in it.

Loaders registered with ``taas.register`` are *externals*: wherever the closure reaches
one (a name, a dict of loaders, a function's default), it is pickled as a reference
``("taas-feed", i)`` that the rank resolves to its prepared loader (rank/loaders.py).
Which externals were reached is how the kernel knows which loaders the cell uses.
"""

from __future__ import annotations

import ast
import re
from typing import Any, Mapping, Sequence

from taas_magic.cell.freenames import free_names
from taas_magic.errors import ClosureError
from taas_magic.transfer.pack import Packing, pack

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


def serialise_closure(closure: Mapping[str, Any], externals: Sequence[Any] = ()) -> Packing:
    """Pickle the closure once, name by name (transfer/pack.py): tensor bytes stay out of band.

    Raises:
        ClosureError: with the first variable that cannot be pickled, its type and pickle's reason.
    """
    packing = pack(list(closure.items()), externals)
    if packing.failed:
        name, type_name, reason = packing.failed[0]
        raise ClosureError(name, type_name, reason)
    return packing
