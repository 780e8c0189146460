"""The cloudpickle pickler every taas pickle of notebook code goes through.

Runs wherever taas pickles notebook code: in the kernel (the closure, a registered loader) and in
rank 0 (its names).

Contract: a function, method, lambda or class defined in a notebook cell keeps its code's
``co_filename`` (``/tmp/ipykernel_.../123.py``, which the kernel's linecache maps to
``Cell In[3]``) and every line number, whatever cloudpickle release is installed.

Why: cloudpickle decides how a code object travels, and 3.1.3 writes every one's
``co_filename`` as ``"<dynamic-code>"`` on purpose (cloudpipe/cloudpickle#560), which
would leave a rank's or a data worker's traceback without the notebook's lines. So code
objects do not go through cloudpickle's reducer at all: :class:`Pickler` reduces each one
to ``marshal.loads(marshal.dumps(code, 2))``, the interpreter's own complete serialisation
of a code object (its nested code objects, file name, line table and exception table
included). ``pickle``'s per-pickler ``dispatch_table`` is the public hook for that;
loading needs nothing of taas (``marshal.loads`` is a builtin), so plain ``pickle.loads``
and ``cloudpickle.loads`` read these pickles as before.

Marshal version 2, not the newest: versions 3 and 4 write back-references and interning
flags that depend on objects' reference counts in the pickling process, so the same code
would pickle to different bytes in the kernel and in rank 0, and an untouched function
would look changed (``returns.py`` compares the two). Version 2 writes neither.

Like cloudpickle's own code reduction, this needs the same Python version on both ends,
which a run has: the ranks and workers run the kernel's interpreter, or, on a cluster,
the same Python that Ray or Slurm was set up with.
"""

from __future__ import annotations

import io
import marshal
import types
from collections import ChainMap
from typing import Any, Callable

import cloudpickle

MARSHAL_VERSION = 2  # no back-references or interning flags: the same bytes in every process


def reduce_code(code: types.CodeType) -> tuple[Callable[[bytes], Any], tuple[bytes]]:
    """A code object as the interpreter serialises it, file name and line numbers included."""
    return marshal.loads, (marshal.dumps(code, MARSHAL_VERSION),)


class Pickler(cloudpickle.Pickler):
    """cloudpickle's Pickler, with code objects carried whole (see the module docstring)."""

    # private API: see taas_magic/private.py (cloudpickle.Pickler.dispatch_table)
    dispatch_table = ChainMap({types.CodeType: reduce_code}, cloudpickle.Pickler.dispatch_table)


def dumps(obj: Any, protocol: int = 5) -> bytes:
    """``cloudpickle.dumps`` through :class:`Pickler`."""
    buffer = io.BytesIO()
    Pickler(buffer, protocol=protocol).dump(obj)
    return buffer.getvalue()
