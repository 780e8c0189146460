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
