"""One real multi-node Slurm on this machine for tests/slurm (tests/slurm/minislurm.py)."""

from __future__ import annotations

import pytest

from tests.slurm.minislurm import MiniSlurm, missing


@pytest.fixture(scope="session")
def slurm():
    why = missing()
    if why is not None:
        pytest.skip(why)
    with MiniSlurm(nodes=3) as cluster:
        yield cluster
