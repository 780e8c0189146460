import os

import pytest

from tests.kernel_client import Kernel, assert_nothing_left


@pytest.fixture(scope="session")
def kernel():
    """One kernel shared by the tests that leave it as they found it."""
    shared = Kernel()
    yield shared
    shared.shutdown()


@pytest.fixture(autouse=True)
def nothing_left_running(request):
    """After every kernel test: no process started for a cell is still alive."""
    yield
    if "kernel" not in request.fixturenames:
        return
    assert_nothing_left(request.getfixturevalue("kernel"))


@pytest.fixture(params=["overlay", "python"])
def mode(request, kernel):
    """The write rule's isolation, both ways (writes/): the overlay, then the Python fallback."""
    ran = kernel.execute(f"%taas config isolation {request.param}")
    assert ran.reply["status"] == "ok", ran.stream()
    yield request.param
    kernel.execute("%taas config isolation auto")


@pytest.fixture()
def repo(kernel, tmp_path, mode):
    """An empty repository (a git work tree's top) that the kernel works in, in each isolation ``mode``."""
    root = tmp_path / "repo"
    (root / ".git").mkdir(parents=True)
    ran = kernel.execute(f"%taas config repo {root}\nimport os\nos.chdir({str(root)!r})")
    assert ran.reply["status"] == "ok", ran.stream()
    yield root
    kernel.execute(f"%taas config repo {os.getcwd()}\nos.chdir({os.getcwd()!r})")
