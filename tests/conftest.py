import pytest

from tests.kernel_client import Kernel, assert_nothing_left


@pytest.fixture
def new_kernel():
    """Kernels of a test's own (``new_kernel(env=...)``); after the test, each is checked like the
    shared one (nothing a cell started is left) and shut down."""
    made: list[Kernel] = []

    def make(**options) -> Kernel:
        made.append(Kernel(**options))
        return made[-1]

    yield make
    try:
        for kernel in made:
            assert_nothing_left(kernel)
    finally:
        for kernel in made:
            kernel.shutdown()
