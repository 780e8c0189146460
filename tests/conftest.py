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


# tests/<one of these>: run on one worker, in its group. tests/ray and tests/slurm share one: each starts clusters of
# its own, but both check that no away host left a layer in this machine's temporary folder, which the other's
# away hosts use too.
GROUPS = {"ray": "clusters", "slurm": "clusters", "browser": "browser"}


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's ``--dist loadgroup`` (the README's command: pyproject.toml's addopts), a module's tests
    run on one worker, in order, so its module fixtures (a kernel kept for the module, kept ranks) are made once;
    tests/ray's and tests/slurm's on one worker together, one Ray cluster and one Slurm at a time as in a run
    without workers (:data:`GROUPS`), and JupyterLab's on one. Those groups are the longest, so they go first: the
    other worker takes the rest meanwhile. Without xdist, or with ``-n 0``, nothing changes."""
    if not config.pluginmanager.hasplugin("xdist") or not config.getoption("numprocesses", None):
        return
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        group = GROUPS.get(parts[1], "/".join(parts)) if len(parts) > 2 else "/".join(parts)
        item.add_marker(pytest.mark.xdist_group(group))
    first = ("clusters", "browser")
    items.sort(key=lambda item: first.index(group) if (group := item.get_closest_marker("xdist_group").args[0]) in first
               else len(first))
