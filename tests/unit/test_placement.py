"""Which hosts a cluster run uses (pure planning), and the cluster mode without Ray."""

import sys

import pytest

from taas_magic.errors import ClusterError, LaunchError
from taas_magic.launch.placement import Node, plan_hosts, worker_blocks
from taas_magic.launch.ray.attachment import import_ray


def node(name: str, total: int, free: int | None = None, notebook: bool = False) -> Node:
    return Node(name * 4, "10.0.0.1", total, total if free is None else free, 8, 8, notebook)


def layout(shares) -> list[tuple[str, int, int, int]]:
    return [(share.node.node_id[:1], share.ranks, share.first_rank, share.group_rank) for share in shares]


@pytest.mark.parametrize(
    ("nodes", "gpus", "per_host", "expected"),
    [
        # the notebook's host first when it has a free GPU, then the most free
        ([node("a", 8), node("b", 8, notebook=True)], 8, None, [("b", 8, 0, 0)]),
        ([node("a", 8), node("b", 8, notebook=True)], 16, None, [("b", 8, 0, 0), ("a", 8, 8, 1)]),
        ([node("a", 2), node("b", 8), node("c", 4, notebook=True)], 10, None, [("c", 4, 0, 0), ("b", 6, 4, 1)]),
        # the notebook's host has no GPU free: rank 0 goes where the GPUs are
        ([node("a", 4), node("b", 4, free=0, notebook=True)], 4, None, [("a", 4, 0, 0)]),
        # a CPU-only notebook host (no GPUs) is never planned
        ([node("a", 2), node("b", 2), node("c", 0, notebook=True)], 4, None, [("a", 2, 0, 0), ("b", 2, 2, 1)]),
        # --per-host caps every host
        ([node("a", 8, notebook=True), node("b", 8)], 4, 2, [("a", 2, 0, 0), ("b", 2, 2, 1)]),
        # not free now: planned on the hosts' totals, for the reservation to wait on
        ([node("a", 2, free=0, notebook=True), node("b", 2, free=1)], 4, None, [("a", 2, 0, 0), ("b", 2, 2, 1)]),
    ],
)
def test_plan_hosts(nodes, gpus, per_host, expected):
    assert layout(plan_hosts(nodes, gpus, per_host)) == expected


@pytest.mark.parametrize(
    ("nodes", "gpus", "per_host", "message"),
    [
        ([node("a", 2), node("b", 2)], 6, None, "--gpus 6 cannot be placed: the cluster has 4 GPU(s) in all"),
        ([node("a", 8), node("b", 8)], 6, 2, "4 GPU(s) in all, at most 2 per host (--per-host)"),
        ([node("c", 0)], 1, None, "on 0 host(s) (no GPU hosts)"),
    ],
)
def test_infeasible_requests_fail_at_once(nodes, gpus, per_host, message):
    with pytest.raises(LaunchError) as failure:
        plan_hosts(nodes, gpus, per_host)
    assert message in str(failure.value)


def test_without_ray_the_cluster_command_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what a missing package looks like to import
    with pytest.raises(ClusterError, match=r'pip install "taas-magic\[ray\]"'):
        import_ray()


@pytest.mark.parametrize(
    ("nodes", "workers", "expected"),
    [
        # CPU-only hosts when there are any, most free CPUs first, contiguous blocks
        ([node("g", 2), node("c", 0), node("d", 0)], 4, [("c", [0, 1]), ("d", [2, 3])]),
        ([node("g", 2), node("c", 0)], 3, [("c", [0, 1, 2])]),
        # no CPU-only host: every host serves
        ([node("a", 2), node("b", 2)], 3, [("a", [0, 1]), ("b", [2])]),
    ],
)
def test_worker_blocks(nodes, workers, expected):
    assert [(n.node_id[:1], ws) for n, ws in worker_blocks(nodes, workers)] == expected
