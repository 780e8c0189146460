"""Collective checkpoints on Slurm nodes that do or do not see the notebook's repository.

The module's kernel holds node1 and node2 with one GPU each, so a 2-rank cell is one task on each
(rank 0 on node1). Each node of the test Slurm has a folder of its own disk
(tests/slurm/minislurm.py: its ``slurmd`` in a mount namespace of its own, an empty tmpfs there):
a repository in node1's folder is seen by the kernel and node2, not by node1, and the other way
round. The product finds that out by itself (writes/away.py's marker); nothing in it knows about
the test. Every test checks the checkpoint whole in the notebook's repository (the kernel's
completeness check, then read back in the notebook), rank 0's other file landed and rank 1's not,
nothing written in the node's own folder, and nothing left on any node.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.collective_save import SAVE, assert_resume_fails_where_the_repository_is_not, assert_whole, save, use_repository
from tests.kernel_client import Kernel, away_layers_left, wait_until_gone
from tests.slurm.test_slurm import cell_processes, job_of, steps

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def kernel(slurm, tmp_path_factory):
    if slurm.node_local("node1") is None:
        pytest.skip("a node's own folder needs mount namespaces (unshare --mount, root)")
    kernel = Kernel(cwd=str(tmp_path_factory.mktemp("start")), env={"SLURM_CONF": str(slurm.conf)})
    ran = kernel.execute("%taas cluster slurm --nodes 2 --gpus-per-node 1 --nodelist node1,node2 --time 30", timeout=120)
    assert ran.reply["status"] == "ok", ran.error_text()
    yield kernel
    kernel.shutdown()


@pytest.fixture(autouse=True)
def nothing_left_on_any_node(kernel):
    yield
    alive = wait_until_gone(cell_processes(), timeout=15)
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"
    assert not away_layers_left(kernel), "an away node's layers"


def _nodes(ran) -> dict[int, str]:
    import re

    return {int(rank): node for rank, node in re.findall(r"\[rank (\d)\] sees \d \w+ (node\d)", ran.stream())}


def test_a_dcp_save_on_two_nodes_that_see_the_repository_is_written_in_place(kernel, slurm, tmp_path):
    use_repository(kernel, tmp_path / "repo")
    ran, seen = save(kernel)
    assert _nodes(ran) == {0: "node1", 1: "node2"} and seen == {0: True, 1: True}, ran.stream()
    assert_whole(kernel, tmp_path / "repo", ran, away=set())
    assert steps(slurm, job_of(kernel)) == []


@pytest.mark.parametrize("node, away", [("node1", 0), ("node2", 1)])
def test_the_parts_of_a_rank_on_a_node_without_the_repository_are_sent_to_it(kernel, slurm, node, away):
    """node1's own folder: rank 0 is away (its part, the .metadata and its own file are sent); node2's: rank 1."""
    _save_away(kernel, slurm, node, away, "overlay")


@pytest.mark.parametrize("node, away", [("node1", 0), ("node2", 1)])
def test_in_the_python_fallback_too(kernel, slurm, node, away):
    ran = kernel.execute("%taas config isolation python")
    assert ran.reply["status"] == "ok", ran.error_text()
    try:
        _save_away(kernel, slurm, node, away, "python")
    finally:
        kernel.execute("%taas config isolation auto")


def _save_away(kernel, slurm, node, away, mode):
    folder = slurm.node_local(node)
    repo = folder / f"repo-{away}-{mode}"
    use_repository(kernel, repo)
    ran, seen = save(kernel)
    assert "diverted by Python" in ran.stream("stdout") if mode == "python" else "(overlay)" in ran.stream("stdout")
    assert _nodes(ran) == {0: "node1", 1: "node2"}, ran.stream()
    assert seen == {rank: rank != away for rank in (0, 1)}, ran.stream()
    assert_whole(kernel, repo, ran, {away})
    slurmd = slurm.daemons[node].pid
    own = subprocess.run(["nsenter", "-t", str(slurmd), "-m", "ls", "-A", str(folder)], capture_output=True, text=True)
    assert own.returncode == 0 and own.stdout == "", own  # nothing written on that node's own disk
    assert steps(slurm, job_of(kernel)) == []


def test_a_rank_whose_cell_raises_after_the_save_still_sends_it(kernel, slurm):
    """Rank 0, on the node without the repository, raises after the save: its part, the .metadata and its own
    file are sent before its error, and the checkpoint is whole; the cell shows the error."""
    repo = slurm.node_local("node1") / "repo-raises"
    use_repository(kernel, repo)
    ran = kernel.execute(SAVE.replace("OPTIONS", "") + "if rank == 0:\n    raise ValueError('after the save')\n", timeout=300)
    assert ran.reply["status"] == "error" and "raised ValueError: after the save" in ran.error_text(), ran.error_text()
    assert sorted(os.listdir(repo / "ckpt" / "step3")) == [".metadata", "__0_0.distcp", "__1_0.distcp"], ran.stream()
    assert "incomplete" not in ran.stream("stderr") and (repo / "stray-0.txt").exists()
    assert "written by rank(s) 0 on hosts that do not see the repository" in ran.stream("stderr"), ran.stream()


def test_a_resume_in_a_later_cell_on_a_node_that_does_not_see_the_repository_fails_with_one_line(kernel, slurm):
    """writes/unseen.py: node2's own folder, so rank 1 is away: it finds rank 0's snapshot by name, and reading it
    fails with one line, rather than starting afresh and waiting for rank 0 forever."""
    use_repository(kernel, slurm.node_local("node2") / "repo-resume")
    assert_resume_fails_where_the_repository_is_not(kernel, "", away=1)
    assert steps(slurm, job_of(kernel)) == []
