"""A reader finds their way by the docstrings: each package's ``__init__.py`` maps its modules and
sub-packages, a line each, and each module says where its code runs.

- The map: every module (``name.py``) and sub-package (``name/``) of a package begins a line of
  its own in the package's ``__init__.py`` docstring (``- ``name.py``: its job``, as
  ``kernel/__init__.py`` does), and every bare file or folder name the docstring gives is there
  (a name elsewhere is written with its path: ``kernel/runs/run.py``), so the map can neither
  miss a module nor name one that is gone.
- Where it runs: every module's docstring (``__main__.py`` and taas.py too) has a sentence
  ``Runs in ...``, ``Runs on ...`` or ``Runs wherever ...``: which process (the kernel, each rank,
  a spare, a data worker, a Ray host agent, a Slurm task, ...) and, where it matters, which thread.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "taas_magic"
ENTRY = re.compile(r"^\s*- ``(\w+\.py|\w+/)``", re.MULTILINE)  # a line of the map
BARE = re.compile(r"(?<![\w./-])(\w+\.py|\w+/)(?![\w.])")  # courier.py, not raycourier.py nor ray/courier.py
RUNS = re.compile(r"\bRuns (in|on|wherever) ")


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def _packages() -> list[Path]:
    return sorted(init.parent for init in PACKAGE.rglob("__init__.py"))


def _contents(package: Path) -> set[str]:
    """What the map must name: the package's modules and sub-packages, ``__init__.py`` aside."""
    modules = {path.name for path in package.glob("*.py") if path.name != "__init__.py"}
    return modules | {path.name + "/" for path in package.iterdir() if (path / "__init__.py").exists()}


@pytest.mark.parametrize("package", _packages(), ids=lambda path: str(path.relative_to(ROOT)) + "/")
def test_each_package_maps_its_modules_a_line_each(package):
    docstring = _docstring(package / "__init__.py")
    unmapped = _contents(package) - set(ENTRY.findall(docstring))
    assert not unmapped, f"{package.relative_to(ROOT)}/__init__.py has no line for {sorted(unmapped)}"


@pytest.mark.parametrize("package", _packages(), ids=lambda path: str(path.relative_to(ROOT)) + "/")
def test_each_map_names_only_what_is_there(package):
    gone = set(BARE.findall(_docstring(package / "__init__.py"))) - _contents(package)
    assert not gone, f"{package.relative_to(ROOT)}/__init__.py names {sorted(gone)}, not in the folder"


def test_a_map_line_is_matched_as_a_word():
    lines = "- ``courier.py``: x\n- ``ray/``: y\n  - ``raycourier.py``: z\nsee ``courier.py``"
    assert ENTRY.findall(lines) == ["courier.py", "ray/", "raycourier.py"]
    assert BARE.findall("courier.py, ray/courier.py, launch/ray/, raycourier.py and ray/ here") == \
        ["courier.py", "raycourier.py", "ray/"]


def _modules() -> list[Path]:
    return [path for path in sorted(PACKAGE.rglob("*.py")) if path.name != "__init__.py"] + [ROOT / "taas.py"]


@pytest.mark.parametrize("path", _modules(), ids=lambda path: str(path.relative_to(ROOT)))
def test_each_module_says_where_it_runs(path):
    name = str(path.relative_to(ROOT))
    docstring = " ".join(_docstring(path).split())  # a sentence may break across lines
    assert RUNS.search(docstring), f"{name}'s docstring does not say where it runs (Runs in / on / wherever ...)"
