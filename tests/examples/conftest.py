"""Public distributed example programs, vendored unchanged but for what a CPU host needs (vendored/<name>/SOURCE.md),
run as taas cells the way a person runs them in a notebook: the program's files in the notebook's folder (the test's
repository), its ``main(...)`` called (or its body pasted) in a 2-rank CPU cell, fresh ranks and kept ranks
(``--keep``), in a real kernel. Each test asserts what the program itself produces: its loss going down, its
checkpoint loading, its resume in a second cell going on from the saved epoch or step.

One kernel for every test a pytest worker runs (its warm spares make the next test's first cell quick). The programs'
modules share names (``model``, ``main``) and the notebook imports them from the repository to load what comes back,
so after each test the notebook forgets them, and the names the test bound.
"""

import ast
import os
import shutil
from pathlib import Path

import pytest

from tests.kernel_client import Kernel, assert_nothing_left

VENDORED = Path(__file__).resolve().parent / "vendored"
# The vendored programs are not this suite's tests, though some are named like them (accelerate's test_sync.py)
collect_ignore = ["vendored"]
CELL = "#pragma taas --gpus 2 --device cpu --output all"


@pytest.fixture(scope="session")
def kernel():
    """The worker's kernel for these tests (see the module docstring)."""
    made = Kernel()
    yield made
    made.shutdown()


@pytest.fixture(params=["fresh", "kept"])
def pragma(request):
    """The cells' first line: fresh ranks for every cell, or ranks kept from one cell to the next."""
    return CELL + (" --keep" if request.param == "kept" else "")


@pytest.fixture()
def program(kernel, tmp_path):
    """``program(name)``: a repository (a git work tree's top) holding vendored/<name>'s sources, the kernel's
    repository and working folder, as a notebook beside the program's files. Afterwards: the kept ranks released,
    nothing a cell started left running, and the program's modules and the test's names forgotten by the notebook."""
    root = tmp_path / "repo"
    modules: list[str] = []

    def make(name: str) -> Path:
        (root / ".git").mkdir(parents=True)
        for source in sorted((VENDORED / name).iterdir()):
            if source.is_file() and source.name not in ("LICENSE", "SOURCE.md"):
                shutil.copy(source, root / source.name)
                modules.append(source.stem)
        ok(kernel, f"%taas config repo {root}\nimport os\nos.chdir({str(root)!r})\n_names_before = set(globals())")
        return root

    yield make
    ran = kernel.execute("%taas release")
    assert ran.reply["status"] == "ok", ran.error_text()
    ok(kernel, f"%taas config repo {os.getcwd()}\nos.chdir({os.getcwd()!r})\nimport sys\n"
               f"for _name in {modules!r}:\n    sys.modules.pop(_name, None)\n"
               "for _name in set(globals()) - globals().get('_names_before', set(globals())):\n"
               "    if not _name.startswith('_'):\n        del globals()[_name]")
    assert_nothing_left(kernel)


def ok(kernel: Kernel, code: str, timeout: float = 180):
    ran = kernel.execute(code, timeout=timeout)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    return ran


def second_cell(ran, pragma: str) -> None:
    """A second cell ran where its pragma says: in the first one's ranks when kept, in new ones when not."""
    kept = "--keep: cell 2 on the kept ranks" in ran.stream()
    assert kept == ("--keep" in pragma), ran.stream()


def printed(ran, rank: int) -> list[str]:
    """Rank ``rank``'s lines (``--output all`` prefixes each with ``[rank k] ``), in order, without the prefix."""
    prefix = f"[rank {rank}] "
    return [line[len(prefix):] for line in ran.stream().splitlines() if line.startswith(prefix)]


def notebook_value(kernel: Kernel, expression: str):
    """``expression`` evaluated in the notebook (the kernel), as a Python literal."""
    return ast.literal_eval(ok(kernel, f"print(repr({expression}))").stream("stdout").strip())


def function_body(path: Path, name: str) -> str:
    """The body of the top-level function ``name`` in ``path``, dedented: what a person pastes into a cell."""
    source = path.read_text()
    function = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name == name)
    lines = source.splitlines()[function.body[0].lineno - 1:function.end_lineno]
    indent = len(lines[0]) - len(lines[0].lstrip())
    return "\n".join(line[indent:] for line in lines) + "\n"
