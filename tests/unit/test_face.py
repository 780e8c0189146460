"""taas.py is the face: it imports the package, never the reverse, and keeps every public name.

Every piece of state the face exposes lives in the package (feed/registry.py, rank/identity.py,
search/trial.py) and is read at each call: the rank bootstrap sets it
before the cell's ``import taas``, and either may be imported first.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import taas

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "taas_magic"

# The public API: its names in __all__'s order, and each one's signature.
PUBLIC = {
    "register": "(loader: 'Any') -> 'Any'",
    "unregister": "(loader: 'Any') -> 'None'",
    "registered": "() -> 'list[Any]'",
    "get_worker_info": "() -> 'Any'",
    "in_rank": "() -> 'bool'",
    "save_checkpoint": "(obj: 'Any', sharded: 'bool | None' = None) -> 'str | None'",
    "load_checkpoint": "(map_location: 'Any' = None, into: 'Any' = None) -> 'Any'",
    "checkpoint_path": "() -> 'str | None'",
    "shared": "(path: 'Any') -> 'str'",
    "report": "(step: 'Any' = None, **metrics: 'Any') -> 'None'",
    "metrics": "() -> 'list[dict]'",
    "lightning_logger": "() -> 'Any'",
    "wait": "(run: 'str | None' = None) -> 'Any'",
    "trial": "() -> 'Any'",
    "trials": "() -> 'Any'",
    "study": "() -> 'Any'",
    "load_job": "(script: 'str') -> 'dict'",
}

_FACE_PATH = re.compile(r"taas(\.[A-Za-z_]\w*)*")  # "taas", "taas.report": the face or a name in it
_IMPORTERS = {"import_module", "__import__", "reload", "find_spec"}
_MODULE_TABLES = {"get", "pop", "setdefault"}  # sys.modules.get("taas") and friends


def _names_face(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and _FACE_PATH.fullmatch(node.value) is not None


def _called(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _is_sys_modules(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(node.value, ast.Name) \
        and node.value.id == "sys"


def _module_list(node: ast.AST) -> bool:
    """A literal list of module names (``("torch", "taas", "taas_magic.rank.loaders")``) that names the face."""
    if not isinstance(node, (ast.Tuple, ast.List, ast.Set)) or not node.elts:
        return False
    strings = [element.value for element in node.elts if isinstance(element, ast.Constant)
               and isinstance(element.value, str)]
    dotted = [value for value in strings if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", value)]
    return len(strings) == len(node.elts) and bool(dotted) and any(_FACE_PATH.fullmatch(value) for value in strings)


def face_imports(source: str) -> list[str]:
    """Each place ``source`` imports the face or reaches into it: ``LINE: what``. Counted anywhere,
    inside functions too: ``import taas``, ``from taas import x``, ``import_module("taas")``,
    ``__import__("taas")``, ``sys.modules["taas"]``, a list of module names that holds it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        what = ""
        if isinstance(node, ast.Import):
            what = ", ".join(alias.name for alias in node.names if _FACE_PATH.fullmatch(alias.name))
            what = f"import {what}" if what else ""
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module and _FACE_PATH.fullmatch(node.module):
            what = f"from {node.module} import ..."
        elif isinstance(node, ast.Call) and node.args and _names_face(node.args[0]) and (
                _called(node.func) in _IMPORTERS
                or (_called(node.func) in _MODULE_TABLES and isinstance(node.func, ast.Attribute)
                    and _is_sys_modules(node.func.value))):
            what = f"{_called(node.func)}({node.args[0].value!r})"
        elif isinstance(node, ast.Subscript) and _is_sys_modules(node.value) and _names_face(node.slice):
            what = f"sys.modules[{node.slice.value!r}]"
        elif isinstance(node, ast.Compare) and any(_is_sys_modules(side) for side in node.comparators) \
                and _names_face(node.left):
            what = f"{node.left.value!r} in sys.modules"
        elif _module_list(node):
            what = "a list of modules to import that names the face"
        if what:
            found.append(f"{node.lineno}: {what}")
    return found


@pytest.mark.parametrize("source", [
    "import taas",
    "import os, taas as t",
    "import taas.report",
    "from taas import registered",
    "def f():\n    import taas\n    return taas.registered()",
    "class C:\n    def m(self):\n        from taas import report",
    "import importlib\nimportlib.import_module('taas')",
    "from importlib import import_module\nimport_module('taas')",
    "__import__('taas')",
    "import sys\nsys.modules['taas']._IN_RANK = True",
    "import sys\nsys.modules.get('taas')",
    "import sys\nif 'taas' in sys.modules: pass",
    "WARM = ('torch', 'taas', 'taas_magic.rank.loaders')",
], ids=lambda source: source.splitlines()[-1].strip())
def test_the_check_finds_each_way_to_import_the_face(source):
    assert face_imports(source), source


@pytest.mark.parametrize("source", [
    "import taas_magic\nfrom taas_magic import checkpoints\nfrom taas_magic.feed import registry",
    "from . import taas_helpers",
    "@cell_magic('taas')\ndef f(): pass",
    "raise RuntimeError('taas.register: not iterable')",
    "manager.magics['line'].get('taas')",
    "ENTRY = \"__import__('taas_magic').run_cell\"",
    "NAMES = ('taas', 'taas-rank')",
], ids=lambda source: source.splitlines()[-1].strip())
def test_the_check_lets_the_package_name_itself(source):
    assert not face_imports(source), face_imports(source)


def test_no_module_of_the_package_imports_the_face():
    importing = {str(path.relative_to(ROOT)): where for path in sorted(PACKAGE.rglob("*.py"))
                 if (where := face_imports(path.read_text()))}
    assert not importing, ("the package imports the face (taas.py), which imports the package: keep the state "
                           f"in the package and let taas.py read it: {importing}")


def test_the_face_keeps_every_public_name_with_its_signature():
    assert taas.__all__ == list(PUBLIC), taas.__all__
    for name, signature in PUBLIC.items():
        function = getattr(taas, name, None)
        assert callable(function), f"taas.{name} is gone"
        assert str(inspect.signature(function)) == signature, (name, str(inspect.signature(function)))
        assert inspect.getdoc(function), f"taas.{name} has no docstring"


def _run(script: str, **environment: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **environment}, timeout=120)


# What the rank bootstrap sets, seen by the face whichever is imported first.
_STATE_CHECK = """
    import taas
    from taas_magic.feed import registry
    from taas_magic.rank import identity

    assert taas.in_rank() is {in_rank} and (taas.get_worker_info() is None) is not {in_rank}
    if {in_rank}:
        info = taas.get_worker_info()
        assert (info.id, info.num_workers, info.seed) == (1, 2, 8), info
    taas.report(3, loss=0.5)
    assert seen == ([(3, {{"loss": 0.5}})] if {in_rank} else []), seen
    loader = taas.register([1, 2])
    assert registry.registered() == [loader] == taas.registered()
    registry.unregister(loader)
    assert taas.registered() == []
    assert taas.metrics() == []  # no kernel session here: the last run's are the session's (kernel/magic/fromcode.py)
    print("ok")
"""


@pytest.mark.parametrize("bootstrap_first", [True, False], ids=["bootstrap-then-import", "import-then-bootstrap"])
def test_the_face_reads_the_package_state_at_each_call(bootstrap_first):
    enter = "from taas_magic.rank import identity\nidentity.enter('cpu', 7, lambda step=None, **m: seen.append((step, m)))\n"
    script = "seen = []\n" + (enter if bootstrap_first else "import taas\n" + enter)
    ran = _run(script + textwrap.dedent(_STATE_CHECK.format(in_rank=True)), RANK="1", WORLD_SIZE="2")
    assert ran.returncode == 0 and ran.stdout == "ok\n", ran.stderr


def test_outside_a_rank_the_face_answers_by_the_defaults():
    alone = _run("seen = []\n" + textwrap.dedent(_STATE_CHECK.format(in_rank=False)))
    assert alone.returncode == 0 and alone.stdout == "ok\n", alone.stderr


def test_the_modules_that_read_or_set_the_state_load_without_the_face():
    modules = ["taas_magic.rank.main", "taas_magic.rank.spare", "taas_magic.kernel.runs.execution", "taas_magic.kernel.runs.runplan",
               "taas_magic.kernel.magic.linecommands", "taas_magic.kernel.trials.searchrun", "taas_magic.feed.registry",
               "taas_magic.rank.identity", "taas_magic.kernel.magic.fromcode", "taas_magic.kernel.magic.commands"]
    ran = _run(f"import importlib, sys\nfor name in {modules!r}:\n    importlib.import_module(name)\n"
               "print(sorted(name for name in sys.modules if name == 'taas' or name.startswith('taas.')))")
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "[]\n", f"importing the package loaded the face: {ran.stdout}"
