"""What an exported job takes of the notebook (taas_magic/export/carry.py): import lines for modules and library
objects, the source of notebook definitions (and what they read, in turn), values pickled with the notebook classes
their pickles name, registered loaders marked; a name that cannot go refused in one line.

The notebook is a real ``__main__`` module whose dict is the namespace, as in a kernel (a notebook class then pickles
by reference, as it does there); ``sys.modules["__main__"]`` is that module for the test only."""

from __future__ import annotations

import collections
import sys
import types
import xml.etree.ElementTree
from xml.etree import ElementTree

import pytest
import torch

from taas_magic.export.carry import Carried, Definition, ExportError, _check_picklable, _global_reads, _import_line, carry


@pytest.fixture
def notebook(monkeypatch):
    """``run(cells)``: the cells (In[N] -> source) run in order in a fresh ``__main__``; its namespace and the cells."""
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)

    def run(cells: dict[int, str]) -> tuple[dict, dict[int, str]]:
        for number in sorted(cells):
            exec(compile(cells[number], f"<In[{number}]>", "exec"), main.__dict__)  # noqa: S102 - the notebook's cells
        return main.__dict__, cells

    return run


def reads(namespace: dict, *names: str) -> dict:
    """A cell's closure: the notebook names it reads, with their values."""
    return {name: namespace[name] for name in names}


@pytest.mark.parametrize("name, value, line", [
    ("json", __import__("json"), "import json"),
    ("js", __import__("json"), "import json as js"),
    ("ET", xml.etree.ElementTree, "import xml.etree.ElementTree as ET"),
    ("ElementTree", ElementTree, "from xml.etree import ElementTree"),
    ("F", torch.nn.functional, "import torch.nn.functional as F"),
    ("OrderedDict", collections.OrderedDict, "from collections import OrderedDict"),
    ("OD", collections.OrderedDict, "from collections import OrderedDict as OD"),
    ("Linear", torch.nn.Linear, "from torch.nn.modules.linear import Linear"),  # where importing gives that object
    ("dumps", __import__("json").dumps, "from json import dumps"),
])
def test_a_module_or_a_librarys_function_or_class_becomes_its_import_line(name, value, line):
    assert _import_line(name, value) == line


@pytest.mark.parametrize("value", [
    3,  # a value
    collections.OrderedDict.fromkeys,  # a bound method: not importable by name
    collections.OrderedDict(),  # an instance of a library class
    type("Local", (), {"__module__": "json", "__qualname__": "Local"}),  # names json.Local, which is not there
    type("Nested", (), {"__module__": "json", "__qualname__": "JSONDecoder.Nested"}),  # a dotted qualname
])
def test_what_importing_would_not_give_back_has_no_import_line(value):
    assert _import_line("name", value) is None


def test_a_notebook_function_goes_by_its_source_with_what_its_body_reads_in_turn(notebook):
    namespace, cells = notebook({
        1: "import json\nimport torch.nn.functional as F\nscale = 0.5\n",
        2: "def helper(v):\n    return F.relu(magnitude(v)) * scale\n\nmagnitude = abs\n",
        3: "unused = 1\n\n\ndef train(steps):\n    local = steps\n    return [helper(local) for _ in range(steps)]\n",
    })
    carried = carry(reads(namespace, "train", "json"), namespace, cells)
    assert carried.imports == {"json": "import json", "F": "import torch.nn.functional as F",
                               "magnitude": "from builtins import abs as magnitude"}
    assert carried.definitions == {
        "train": Definition("train", 3, 4, "def train(steps):\n    local = steps\n"
                                           "    return [helper(local) for _ in range(steps)]\n"),
        "helper": Definition("helper", 2, 1, "def helper(v):\n    return F.relu(magnitude(v)) * scale\n"),
    }
    assert carried.values == {"scale": 0.5}  # not `unused`, not `steps` or `local`: the function's own
    assert [d.name for d in carried.ordered_definitions()] == ["helper", "train"]


def test_the_last_top_level_definition_goes_with_its_decorators_and_a_lambda_by_its_line(notebook):
    namespace, cells = notebook({
        1: "def tag(f):\n    return f\n\ndef step(x):\n    return x\n",
        2: "k = 3\nif True:\n    def step(x):\n        return -x\n",  # not at the top level: not this one
        3: "@tag\n@tag\ndef step(x):\n    return x + 1\n\nsquare = lambda v: v * v * k\n",
        4: "if False:\n    def step(x):\n        return 0\n",  # nor this one, though the last
    })
    carried = carry(reads(namespace, "step", "square"), namespace, cells)
    assert carried.definitions["step"] == Definition("step", 3, 1, "@tag\n@tag\ndef step(x):\n    return x + 1\n")
    assert carried.definitions["square"] == Definition("square", 3, 6, "square = lambda v: v * v * k\n")
    assert carried.definitions["tag"] == Definition("tag", 1, 1, "def tag(f):\n    return f\n")
    assert carried.values == {"k": 3}


def test_a_class_its_base_cell_first_and_an_instance_takes_its_class(notebook):
    namespace, cells = notebook({
        1: "import torch\nclass Trunk(torch.nn.Module):\n    width = 4\n",
        2: "class Net(Trunk):\n    def forward(self, x):\n        return x * self.width\n\nnet = Net()\n",
    })
    carried = carry(reads(namespace, "net"), namespace, cells)
    assert [(d.name, d.cell, d.line) for d in carried.ordered_definitions()] == [("Trunk", 1, 2), ("Net", 2, 1)]
    assert carried.imports == {"torch": "import torch"}
    assert list(carried.values) == ["net"] and carried.values["net"] is namespace["net"]


def test_a_notebook_class_a_values_pickle_names_goes_too(notebook):
    """A DataLoader over a Dataset class of the notebook: only its pickle says it needs ``Squares``."""
    namespace, cells = notebook({
        1: "import torch\nclass Squares(torch.utils.data.Dataset):\n    def __len__(self):\n        return 8\n\n"
           "    def __getitem__(self, i):\n        return i * i\n",
        2: "loader = torch.utils.data.DataLoader(Squares(), batch_size=4)\n",
    })
    carried = carry(reads(namespace, "loader"), namespace, cells, registered=[namespace["loader"]])
    assert list(carried.definitions) == ["Squares"]
    assert list(carried.values) == ["loader"] and carried.loaders == ["loader"]


def test_only_the_registered_loader_itself_is_fed(notebook):
    namespace, cells = notebook({1: "feed = [1, 2]\nsame = [1, 2]\n"})
    carried = carry(reads(namespace, "feed", "same"), namespace, cells, registered=[namespace["feed"]])
    assert carried.values == {"feed": [1, 2], "same": [1, 2]} and carried.loaders == ["feed"]


def test_a_name_the_namespace_lacks_is_left_out_and_an_empty_closure_takes_nothing(notebook):
    namespace, cells = notebook({1: "x = 1\n"})
    assert carry({"x": 1, "gone": 2}, namespace, cells) == Carried(values={"x": 1})
    assert carry({}, namespace, cells) == Carried()


def test_a_function_no_cell_defines_at_its_top_level_is_refused_in_one_line(notebook):
    namespace, cells = notebook({1: "def make():\n    def inner():\n        return 1\n    return inner\n\nf = make()\n",
                                 2: "g = eval('lambda: 2')\n"})
    with pytest.raises(ExportError) as refused:
        carry(reads(namespace, "f"), namespace, cells)
    assert str(refused.value) == ("taas: f (a function made in the notebook) cannot go with the job: no cell defines "
                                  "it at its top level as `def f`, `class f` or `f = lambda ...`")
    with pytest.raises(ExportError) as refused:
        carry(reads(namespace, "g"), namespace, cells)
    assert str(refused.value).startswith("taas: g (a lambda made in the notebook) cannot go with the job: ")


def test_a_value_that_cannot_be_pickled_is_refused_naming_what_reads_it(notebook):
    namespace, cells = notebook({1: "import threading\nlock = threading.Lock()\n",
                                 2: "def guarded():\n    with lock:\n        return 1\n"})
    with pytest.raises(ExportError) as refused:
        carry(reads(namespace, "lock"), namespace, cells)
    assert str(refused.value) == "taas: lock (lock) cannot go with the job: TypeError: cannot pickle '_thread.lock' object"
    with pytest.raises(ExportError) as refused:
        carry(reads(namespace, "guarded"), namespace, cells)
    assert str(refused.value) == ("taas: lock, which guarded reads, (lock) cannot go with the job: TypeError: cannot "
                                  "pickle '_thread.lock' object")


def test_a_generator_is_refused_naming_what_reads_it(notebook):
    namespace, cells = notebook({1: "numbers = (i for i in range(3))\nnext_one = lambda: next(numbers)\n"})
    with pytest.raises(ExportError) as refused:
        carry(reads(namespace, "next_one"), namespace, cells)
    assert str(refused.value) == ("taas: numbers, which next_one reads, (a generator) cannot go with the job: make it "
                                  "in the cell, or a list")


def test_a_pickle_names_each_notebook_class_once_even_through_the_memo(notebook):
    """The second class's module string is a memo reference (BINGET), not a new string: still read as __main__."""
    namespace, _ = notebook({1: "import torch\nclass A:\n    pass\n\nclass B:\n    class Inner:\n        pass\n\n"
                                "both = [A(), B(), B.Inner(), A(), torch.zeros(3)]\n"})
    assert _check_picklable("both", namespace["both"]) == {"A", "B"}
    assert _check_picklable("plain", {"t": torch.ones(2), "s": "__main__"}) == set()


def test_a_definitions_global_reads_leave_out_its_parameters_and_locals():
    assert _global_reads("def f(x, n=default):\n    y = x + scale\n    def g():\n        return y + other\n"
                         "    return g\n") == {"default", "scale", "other"}
    assert _global_reads("class A(Base):\n    k = kconst\n    def m(self):\n        return helper(self)\n") == {
        "Base", "kconst", "helper"}
    assert _global_reads("    def indented(self):\n        return shift\n") == {"shift"}


def test_an_unpicklable_error_is_cut_to_its_first_line(notebook):
    namespace, cells = notebook({1: "class Refuses:\n    def __reduce__(self):\n        raise ValueError('no\\nmore')\n\n"
                                    "r = Refuses()\n"})
    with pytest.raises(ExportError) as refused:
        carry(reads(namespace, "r"), namespace, cells)
    assert str(refused.value) == "taas: r (Refuses) cannot go with the job: ValueError: no"

