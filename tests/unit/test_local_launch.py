import os
import select
import sys
import time

import pytest

from taas_magic.launch.contract import LaunchPlan
from taas_magic.launch.local.processes import LocalProcessGroup
from taas_magic.wire import Placement


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="pidfds need Linux 5.3+ and Python 3.9+")
def test_a_ranks_exit_fd_wakes_the_supervisor_and_closes_with_the_group():
    plan = LaunchPlan(1, [dict(os.environ)], os.getcwd(), "HOST PORT KEY", [Placement(0, "rank 0")])
    exits_after_handshake = (sys.executable, "-c", "import sys; sys.stdin.readline(); sys.exit(3)")
    group = LocalProcessGroup.start(plan, command=exits_after_handshake)
    rank = group.children[0]
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


ARMED_AND_WAITING = (
    "import sys, time\n"
    "from taas_magic.autopsy import dump\n"
    "sys.stdin.readline()\n"
    "dump.arm(sys.argv[1])\n"
    "def waiting_here():\n"
    "    time.sleep(60)\n"
    "waiting_here()\n"
)


def test_a_rank_armed_at_its_plans_stack_file_answers_the_autopsy(tmp_path):
    """The stack file travels in the plan (and the spec), not the environment: the launcher reads the dump there."""
    path = str(tmp_path / "rank-0")
    env = {key: value for key, value in os.environ.items() if not key.startswith("TAAS_")}
    plan = LaunchPlan(1, [env], os.getcwd(), "HOST PORT KEY", [Placement(0, "rank 0")], [path])
    group = LocalProcessGroup.start(plan, command=(sys.executable, "-c", ARMED_AND_WAITING, path))
    try:
        deadline = time.monotonic() + 30
        while not (os.path.exists(path) and os.path.getsize(path)):
            assert time.monotonic() < deadline, "the rank never armed"
            time.sleep(0.05)
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert "waiting_here" in group.stacks([0])[0]
    finally:
        group.close()


def test_a_plans_part_is_one_hosts_ranks_renumbered_from_zero():
    places = [Placement(rank, f"rank {rank}") for rank in range(4)]
    plan = LaunchPlan(4, [{"RANK": str(rank)} for rank in range(4)], "/cwd", "H P K", places, [f"f{rank}" for rank in range(4)])
    part = plan.part(1, 2)
    assert (part.world_size, [env["RANK"] for env in part.envs], list(part.stack_files)) == (2, ["1", "2"], ["f1", "f2"])
    assert [place.peer_id for place in part.places] == [1, 2]  # ids stay global: they name the peer on the wire
    assert (part.cwd, part.handshake) == ("/cwd", "H P K")
