import os
import select
import sys

import pytest

from taas_magic.launch.base import LaunchPlan
from taas_magic.launch.local import LocalRankGroup


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds need Linux 5.3+ and Python 3.9+")
def test_a_ranks_exit_fd_wakes_the_supervisor_and_closes_with_the_group():
    plan = LaunchPlan(1, [dict(os.environ)], os.getcwd(), "HOST PORT KEY")
    exits_after_handshake = (sys.executable, "-c", "import sys; sys.stdin.readline(); sys.exit(3)")
    group = LocalRankGroup.start(plan, command=exits_after_handshake)
    rank = group.ranks[0]
    fd = rank.exit_fd
    try:
        assert fd is not None and "pidfd" in _what_fd_is(fd)
        readable, _, _ = select.select([fd], [], [], 30)
        assert readable == [fd]  # readable as soon as it exited: no polling needed
        assert rank.poll() == 3
    finally:
        group.close()
    assert rank.exit_fd is None
    assert "pidfd" not in _what_fd_is(fd)  # closed with the group: nothing leaks per cell


def _what_fd_is(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "closed"
