"""Notebook code keeps its file name and lines through a pickle, whatever cloudpickle does
(cloudpickle 3.1.3 writes every code object's co_filename as "<dynamic-code>")."""

from __future__ import annotations

import linecache
import pickle
import subprocess
import sys
import textwrap
import traceback

import cloudpickle

from taas_magic.transfer import pickler
from taas_magic.transfer.pack import pack

CELL_FILE = "/tmp/ipykernel_4242/1234567890.py"  # the file name ipykernel gives a cell
CELL = textwrap.dedent(
    """\
    import math

    def helper(x):
        y = x * 2
        raise ValueError(f"bad {y}")

    class Model:
        scale = 3

        def forward(self, x):
            return helper(x * self.scale)

    square = lambda v: v * v
    """
)


def _cell_namespace() -> dict:
    namespace: dict = {"__name__": "__main__"}  # as in a notebook: pickled by value, never by reference
    exec(compile(CELL, CELL_FILE, "exec"), namespace)  # noqa: S102 - defining the cell's code is the point
    return namespace


def _load_and_fail(blob: bytes) -> str:
    """Load in a fresh interpreter (nothing of the cell there) and return the traceback's text."""
    script = textwrap.dedent(
        """\
        import pickle, sys, traceback
        Model, helper, square = pickle.loads(sys.stdin.buffer.read())
        assert square(3) == 9
        try:
            Model().forward(1)
        except ValueError:
            sys.stdout.write(traceback.format_exc())
        sys.stdout.write("lines: %d %d %d" % (helper.__code__.co_firstlineno,
                         Model.forward.__code__.co_firstlineno, square.__code__.co_firstlineno))
        sys.stdout.write(" files: " + " ".join(sorted({helper.__code__.co_filename,
                         Model.forward.__code__.co_filename})))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], input=blob, capture_output=True, timeout=60, check=True)
    return done.stdout.decode()


def test_functions_methods_lambdas_and_classes_keep_the_cells_file_name_and_lines():
    namespace = _cell_namespace()
    blob = pickler.dumps((namespace["Model"], namespace["helper"], namespace["square"]))
    text = _load_and_fail(blob)
    assert f'File "{CELL_FILE}", line 5, in helper' in text
    assert f'File "{CELL_FILE}", line 11, in forward' in text
    assert "lines: 3 10 13" in text
    assert f"files: {CELL_FILE}" in text
    assert "<dynamic-code>" not in text


def test_the_closure_and_results_pickler_carries_them_too():
    namespace = _cell_namespace()
    packing = pack([("helper", namespace["helper"]), ("Model", namespace["Model"]), ("square", namespace["square"])])
    assert CELL_FILE.encode() in packing.skeleton  # how the kernel finds which cells' lines to send
    loaded = pickle.loads(packing.skeleton)  # segments in order: the first name's value
    assert loaded.__code__.co_filename == CELL_FILE


def test_the_traceback_reads_the_cells_lines_from_linecache():
    """As a rank does after registering the earlier cells' lines (rank/execute.py)."""
    namespace = _cell_namespace()
    helper = pickle.loads(pickler.dumps(namespace["helper"]))
    lines = CELL.splitlines(keepends=True)
    linecache.cache[CELL_FILE] = (len(CELL), None, lines, CELL_FILE)
    try:
        helper(1)
    except ValueError:
        text = traceback.format_exc()
    finally:
        del linecache.cache[CELL_FILE]
    assert 'raise ValueError(f"bad {y}")' in text


def test_the_same_code_pickles_to_the_same_bytes_in_another_process():
    """Rank 0 compares a shipped value's pickle with the kernel's: untouched code must match."""
    namespace = _cell_namespace()
    blob = pickler.dumps(namespace["helper"])
    script = (
        "import pickle, sys; from taas_magic.transfer import pickler\n"
        "sys.stdout.buffer.write(pickler.dumps(pickle.loads(sys.stdin.buffer.read())))"
    )
    again = subprocess.run([sys.executable, "-c", script], input=blob, capture_output=True, timeout=60, check=True)
    assert again.stdout == blob


def test_cloudpickle_loads_what_the_pickler_wrote():
    namespace = _cell_namespace()
    helper = cloudpickle.loads(pickler.dumps(namespace["helper"]))
    assert helper.__code__.co_filename == CELL_FILE
