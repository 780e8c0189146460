import ast
import os
import threading

import pytest

from taas_magic.cell.closure import select_closure, serialise_closure
from taas_magic.cell.freenames import free_names
from taas_magic.errors import ClosureError


class Bomb:
    def __reduce__(self):
        raise AssertionError("an unused notebook name was pickled")


def test_only_used_names_are_selected():
    user_ns = {"x": 1, "unused": Bomb(), "f": len, "In": [], "_i3": "", "_": None, "__name__": "__main__"}
    tree = ast.parse("y = f(x) + 1\nIn\n_i3\n_\n")
    assert select_closure(tree, user_ns, {"In": user_ns["In"]}) == {"x": 1, "f": len}


def test_a_rerun_cell_does_not_ship_what_it_rebinds():
    """Rerunning a cell: the last run's model and optimizer are in the notebook (one of
    them unpicklable here), and the cell binds both again before using them."""
    user_ns = {"model": Bomb(), "opt": threading.Lock(), "lr": 0.1}
    tree = ast.parse("model = make()\nopt = SGD(model, lr)\nfor _ in range(3):\n    opt.step()\n")
    assert select_closure(tree, user_ns, {}) == {"lr": 0.1}


def test_names_in_nested_scopes_and_ipython_strings_count():
    source = (
        "def g():\n    return helper(a)\n"
        "get_ipython().system('echo $b {c}')\n"
        "get_ipython().run_line_magic('time', 'z = d + 1')\n"
    )
    names = free_names(ast.parse(source))
    assert {"helper", "a", "b", "c", "d"} <= names


def _round_trip(packing):
    from taas_magic.transfer import memfile, unpack

    data = memfile.write(packing.blobs, "taas-test-", os.getpid(), "unit")
    places = [("at", offset, size) for offset, size in zip(data.offsets, data.sizes)]
    values, failed = unpack.load(packing.skeleton, packing.segments, unpack.resolver(unpack.Blobs(places, data.inline)))
    assert not failed
    return values


def test_serialised_once_and_round_trips():
    def notebook_fn(v):
        return v * 2

    back = _round_trip(serialise_closure({"fn": notebook_fn, "data": [1, 2]}))
    assert back["fn"](3) == 6 and back["data"] == [1, 2]


def test_unpicklable_name_is_named_with_its_type():
    with pytest.raises(ClosureError) as info:
        serialise_closure({"ok": 1, "lock": threading.Lock()})
    assert info.value.name == "lock"
    assert "lock" in str(info.value) and "_thread.lock" in str(info.value)


def test_function_capturing_something_unpicklable_is_named():
    lock = threading.Lock()

    def uses_lock():
        return lock

    with pytest.raises(ClosureError) as info:
        serialise_closure({"uses_lock": uses_lock})
    assert info.value.name == "uses_lock" and info.value.type_name == "function"


def test_modules_travel_by_name_and_are_reimported():
    import json

    packing = serialise_closure({"j": json})
    assert len(packing.skeleton) < 100  # a reference, not the module's contents
    assert _round_trip(packing)["j"] is json
