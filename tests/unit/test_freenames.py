"""What a cell's closure must hold: the names it may read before binding them."""

import ast
import builtins

import pytest

from taas_magic.cell.freenames import free_names


def free(source: str) -> set[str]:
    return free_names(ast.parse(source)) - set(dir(builtins))


CASES = [
    # a rerun training cell binds everything it uses before using it: nothing to ship
    ("import torch\nmodel = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
     "for i in range(3):\n    opt.step()\nprint(i)\n", {"i"}),
    ("x = x + 1", {"x"}),
    ("x += 1", {"x"}),
    ("y = f(x)", {"f", "x"}),
    ("a, (b, *c) = data\nprint(a, b, c)", {"data"}),
    ("model.weight = w\nmodel = None", {"model", "w"}),  # an attribute target reads its base
    ("d[k] = 1", {"d", "k"}),
    ("import os.path as p, numpy\nfrom m import n as q\np, numpy, q, os", {"os"}),
    ("from m import *\nz", {"z"}),
    ("x: int\nprint(x)", {"x"}),
    ("x: int = 1\nprint(x)", set()),
    # nested scopes count where the def stands
    ("def g():\n    return helper(a)\nhelper = 1\na = 2\ng()", {"helper", "a"}),
    ("helper = 1\ndef g():\n    return helper(a)\ng()", {"a"}),
    ("def g(v=default):\n    local = v\n    return local\n", {"default", "local", "v"}),  # its locals too: harmless
    ("class C(Base):\n    attr = value\n", {"Base", "value"}),
    ("f = lambda: late\nlate = 1\nf()", {"late"}),
    # branches and loops
    ("if c:\n    x = 1\nelse:\n    x = 2\nprint(x)", {"c"}),
    ("if c:\n    x = 1\nprint(x)", {"c", "x"}),
    ("for b in loader:\n    y = b\n    print(y)\nprint(y)", {"loader", "y"}),
    ("while cond:\n    n = 1\nprint(n)", {"cond", "n"}),
    ("for t in items:\n    pass\nelse:\n    print(t)", {"items", "t"}),
    ("for obj.attr in xs:\n    pass", {"obj", "xs"}),
    ("with open(p) as f, wrap(f) as g:\n    inner = f.read()\nprint(f, g, inner)", {"p", "wrap", "f", "inner"}),
    ("try:\n    r = run()\nexcept ValueError as e:\n    print(e)\nelse:\n    print(r)\nfinally:\n    done = 1\nprint(r, done)", {"run", "r", "e"}),
    # deletions always ship the name, so the notebook sees them deleted
    ("x = 1\ndel x", {"x"}),
    ("x = 1\nif c:\n    del x\nprint(x)", {"x", "c"}),
    ("def drop():\n    global w\n    del w\nw = 1\ndrop()\nprint(w)", {"w"}),
    # IPython command strings read, and bind nothing
    ("get_ipython().system('echo $b {c}')\nget_ipython().run_line_magic('time', 'z = d + 1')\nprint(z)",
     {"get_ipython", "echo", "b", "c", "time", "z", "d"}),
    ("match v:\n    case [h, *rest]:\n        pass\nprint(h)", {"v", "h"}),
    ("(n := 3)\nprint(n)", {"n"}),
]


@pytest.mark.parametrize("source, expected", CASES)
def test_free_names(source, expected):
    assert free(source) == expected


class Sentinel:
    """Any value: usable as a function, a context manager, an iterable, a base class..."""

    def __call__(self, *args, **kwargs):
        return self

    def __getattr__(self, name):
        return self

    def __iter__(self):
        return iter([self, self])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __bool__(self):
        return False  # so `while cond:` ends

    def __add__(self, other):
        return self

    __radd__ = __iadd__ = __add__

    def __setitem__(self, key, value):
        pass


def _outcome(source: str, namespace: dict) -> str:
    try:
        exec(compile(source, "<cell>", "exec"), namespace)
    except Exception as exc:  # noqa: BLE001 - what matters is that both runs end alike
        return type(exc).__name__
    return "ok"


@pytest.mark.parametrize("source", [case[0] for case in CASES if "get_ipython" not in case[0]
                                    and "import" not in case[0] and "class" not in case[0]])
def test_running_with_only_the_free_names_ends_as_with_every_name(source):
    """Soundness, checked by running: the cell, given only its free names, ends exactly as
    it does given every name it mentions (no NameError that the notebook would not raise),
    and binds the same names."""
    mentioned = {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}
    everything = {name: Sentinel() for name in mentioned - set(dir(builtins))}
    shipped = {name: value for name, value in everything.items() if name in free_names(ast.parse(source))}
    full, only_free = dict(everything), dict(shipped)
    assert _outcome(source, only_free) == _outcome(source, full)
    changed = {name for name, value in full.items() if everything.get(name) is not value}
    assert changed == {name for name, value in only_free.items() if everything.get(name) is not value}
