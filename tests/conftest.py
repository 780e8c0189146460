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


FIRST = ("tests/ray/", "tests/slurm/", "tests/browser/")  # the longest files: sent out first


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (the README's command: ``-n 2 --dist loadfile``, pyproject.toml's addopts), the files
    of tests/ray, tests/slurm and tests/browser first: they take longest, so the other worker takes the rest
    meanwhile. Only in a worker (xdist's workers collect, each the same way); without xdist, or with ``-n 0``, the
    order is pytest's own."""
    if getattr(config, "workerinput", None) is None:
        return
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))
