"""Where the ranks of a cluster run: which hosts, how many ranks on each (pure planning).

Runs in the kernel, where a cluster's backend places a run (the cell's thread) or places a lost host
again (the run's own thread).

The plan packs ranks onto as few hosts as possible, the notebook's own host first when it
has a free GPU (so rank 0's saves land in the person's repository), then the hosts with
the most free GPUs. ``per_host`` caps the ranks on any host (``--per-host``), for people
who want the same shape on every host. Ranks are numbered host by host in plan order, so
rank 0 is on the first host and ``GROUP_RANK`` is the host's position, as torchrun does.

Planning reads Ray's view of free GPUs; the reservation (a placement group with one
bundle per planned host, each pinned to its node) is what actually holds them, and it is
waited for with a deadline, never forever.
"""

from __future__ import annotations

from dataclasses import dataclass

from taas_magic.errors import LaunchError


@dataclass(frozen=True)
class Node:
    """One alive cluster node as Ray reports it."""

    node_id: str
    address: str
    gpus_total: int
    gpus_free: int
    cpus_total: float
    cpus_free: float
    is_notebook_host: bool = False

    @property
    def label(self) -> str:
        """How a person can tell hosts apart (on one machine, simulated nodes share an address)."""
        return f"{self.address} (node {self.node_id[:8]})"


@dataclass(frozen=True)
class RankSlot:
    """Where one rank runs, in torchrun's terms (the local mode: one host, group 0)."""

    rank: int
    local_rank: int
    local_world_size: int
    group_rank: int


@dataclass(frozen=True)
class HostShare:
    node: Node
    ranks: int
    first_rank: int  # global rank of this host's LOCAL_RANK 0
    group_rank: int  # the host's position, torchrun's GROUP_RANK


def plan_hosts(nodes: list[Node], gpus: int, per_host: int | None = None) -> list[HostShare]:
    """Split ``gpus`` ranks over hosts, one GPU each.

    Raises:
        LaunchError: the cluster has too few GPUs in all: at once, nothing waits. (Too few
            free now is the reservation's to wait for, with its deadline.)
    """
    gpu_nodes = [node for node in nodes if node.gpus_total > 0]
    total = sum(min(node.gpus_total, per_host or node.gpus_total) for node in gpu_nodes)
    if total < gpus:
        cap = f" at most {per_host} per host (--per-host)," if per_host else ""
        raise LaunchError(
            f"taas: --gpus {gpus} cannot be placed: the cluster has {total} GPU(s) in all,{cap} "
            f"on {len(gpu_nodes)} host(s) ({describe_free(nodes)}); ask for fewer or add hosts"
        )
    order = sorted(gpu_nodes, key=lambda node: (not node.is_notebook_host, -node.gpus_free, node.node_id))
    shares = _pack(order, gpus, per_host, free=True)
    if shares is None:
        # Not free now (or Ray's view lags a just-released run): plan on what the hosts
        # have; the reservation then waits, up to its deadline, for those GPUs.
        shares = _pack(order, gpus, per_host, free=False)
    assert shares is not None  # the totals suffice (checked above)
    return shares


def _pack(order: list[Node], gpus: int, per_host: int | None, free: bool) -> list[HostShare] | None:
    shares: list[HostShare] = []
    placed = 0
    for node in order:
        have = node.gpus_free if free else node.gpus_total
        take = min(have, per_host or have, gpus - placed)
        if take <= 0:
            continue
        shares.append(HostShare(node, take, placed, len(shares)))
        placed += take
        if placed == gpus:
            return shares
    return None


def describe_free(nodes: list[Node]) -> str:
    free = [f"{node.label}: {node.gpus_free}/{node.gpus_total} GPU free" for node in nodes if node.gpus_total]
    return ", ".join(free) or "no GPU hosts"


def worker_blocks(nodes: list[Node], workers: int) -> list[tuple[Node, list[int]]]:
    """Where the ``workers`` data workers run: CPU-only hosts when the cluster has any
    (every host otherwise), most free CPUs first, spread evenly in contiguous blocks of
    worker indices, one block per host used."""
    cpu_only = [node for node in nodes if node.gpus_total == 0]
    pool = sorted(cpu_only or nodes, key=lambda node: (-node.cpus_free, node.node_id))
    blocks: dict[str, tuple[Node, list[int]]] = {}
    for worker in range(workers):
        node = pool[worker * len(pool) // workers]
        blocks.setdefault(node.node_id, (node, []))[1].append(worker)
    return list(blocks.values())
