import pytest

from tests.kernel_client import Kernel, wait_until_gone


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
    shared = request.getfixturevalue("kernel")
    alive = wait_until_gone(shared.children(), timeout=5)
    assert not alive, f"processes left behind: {[(p.pid, p.cmdline()) for p in alive]}"
