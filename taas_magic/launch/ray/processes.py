"""Ranks on a Ray cluster: a placement group, one agent per host, the local machinery on each.

Runs in the kernel: the placement group and its agents are made as the backend is placed (the cell's
thread), each attempt's ranks started and watched on the run's own thread; :class:`HostAgent` itself
runs in each Ray host agent.

The kernel plans the hosts (``placement.py``), reserves their GPUs with one placement
group (one bundle per host, pinned to that host's node id, so the plan is what Ray
holds), waits for it with a deadline, and starts one :class:`~.agent.HostAgent` actor in
each bundle. Each agent starts its host's ranks as the local mode does and connects
their output back to the kernel's :class:`OutputHub`; the ranks connect to the kernel's
rank server themselves. The supervisor then sees a :class:`RayProcessGroup` exactly as it
sees a local one: output fds (sockets here), exit codes, ``stop`` and ``close``.

Nothing outlives the run: a group's ``close`` has every agent stop and reap its ranks (and
what they left), so a restart (``--restarts``) starts the next attempt through the same
agents; ``RayLaunch.release`` then kills the agents and removes the placement group. If
the kernel dies, Ray kills the actors it owns, and every rank's lifeline to its agent breaks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, Sequence

from taas_magic.errors import LaunchError
from taas_magic.launch.contract import WORKER_COMMAND, ChildProcess, LaunchPlan
from taas_magic.launch.hosts.agent import HostAgent
from taas_magic.launch.hosts.outputhub import HostControl, OutputHub
from taas_magic.launch.placement import HostShare, Node, RankSlot, describe_free, worker_blocks
from taas_magic.launch.ray.courier import RayCourier
from taas_magic.peers import STREAMS, HubChannels

SHUTDOWN_PATIENCE = 10.0  # seconds for the agents to stop and reap their ranks before ray.kill
LOST_HOST_PATIENCE = 10.0  # seconds an agent may take to answer before its host counts as gone
AUTOPSY_PATIENCE = 1.5  # seconds for the agents to return their ranks' stacks (each takes at most 1 s)


class Reservation:
    """One placement group: a bundle of GPUs per planned host, pinned to that host."""

    def __init__(self, ray: Any, shares: Sequence[HostShare], timeout: float, nodes: Callable[[], list[Node]]):
        from ray.util.placement_group import NODE_ID_LABEL_KEY, placement_group, remove_placement_group

        self._remove = remove_placement_group
        self.shares = list(shares)
        self.group = placement_group(
            [{"GPU": share.ranks} for share in shares],
            strategy="PACK",
            bundle_label_selector=[{NODE_ID_LABEL_KEY: share.node.node_id} for share in shares],
        )
        ready, _ = ray.wait([self.group.ready()], timeout=timeout)
        if not ready:
            self.release()
            hosts = ", ".join(f"{share.ranks} on {share.node.label}" for share in shares)
            raise LaunchError(
                f"taas: the cluster did not grant the GPUs within {timeout:g} s ({hosts}); other "
                f"jobs hold them, or a host went away. Nothing was started. Free now: {describe_free(nodes())}. "
                "Wait and run again, ask for fewer, or raise --place-timeout."
            )

    def release(self) -> None:
        try:
            self._remove(self.group)
        except Exception:  # noqa: BLE001 - already removed, or the cluster is gone
            pass


@dataclass
class RayChild:
    index: int
    host: str
    stdout_fd: int
    stderr_fd: int
    control: HostControl
    local_index: int
    exit_fd: int | None = None  # exit codes arrive on the host's control channel, polled

    def poll(self) -> int | None:
        return self.control.poll(self.local_index)


class RayProcessGroup:
    """The ranks (or data workers) of one run across hosts, one agent per host."""

    def __init__(self, ray: Any, agents: list, hub: OutputHub, ranks: list[RayChild]):
        self._ray = ray
        self._agents = agents
        self._hub = hub
        self.children = ranks
        self._closed = False
        self._shares: list[tuple[int, int]] = []  # each agent's first (global) rank and how many

    @classmethod
    def start(cls, ray: Any, hosts: list[tuple[Any, LaunchPlan, str]],
              hub_address: str, key: bytes, timeout: float = 120.0, **start_options: Any) -> "RayProcessGroup":
        """Start each host's processes through its agent (``hosts``: agent, plan, label), numbered
        host by host from 0; return once all their output channels are connected."""
        world = sum(plan.world_size for _, plan, _ in hosts)
        agents = [agent for agent, _, _ in hosts]
        channels = HubChannels(world, len(hosts))
        hub = OutputHub(hub_address, key, len(channels))
        group = cls(ray, agents, hub, [])
        try:
            starting, first = [], 0
            for index, (agent, plan, _) in enumerate(hosts):
                starting.append(agent.start.remote(plan, first, hub.handshake, channels.control(index), **start_options))
                group._shares.append((first, plan.world_size))
                first += plan.world_size
            hub.collect(time.monotonic() + timeout, starting, ray)
            first = 0
            for index, (_, plan, label) in enumerate(hosts):
                control = HostControl(hub.connected[channels.control(index)], label)
                for local in range(plan.world_size):
                    rank = first + local
                    group.children.append(RayChild(
                        rank, label,
                        hub.connected[channels.stream(rank, "stdout")].fileno(),
                        hub.connected[channels.stream(rank, "stderr")].fileno(),
                        control, local,
                    ))
                first += plan.world_size
        except BaseException:
            group.close()
            raise
        return group

    def interrupt(self, ranks: Sequence[int]) -> None:
        """Each host's agent signals its ranks among them (one that does not answer: its ranks are stopped later)."""
        try:
            self._ray.get([agent.interrupt.remote(list(ranks)) for agent in self._agents], timeout=SHUTDOWN_PATIENCE)
        except Exception:  # noqa: BLE001 - an agent (or its host) is gone: the stop after this finds its ranks gone
            pass

    def stop(self, graceful: bool = True) -> list[str]:
        signals: list[str] = []
        try:
            stopping = [agent.stop.remote(graceful) for agent in self._agents]
            for taken in self._ray.get(stopping, timeout=SHUTDOWN_PATIENCE):
                signals += [name for name in taken if name not in signals]
        except Exception:  # noqa: BLE001 - an agent (or its host) is gone: its ranks' lifelines broke with it,
            pass  # and close() kills what is left; the run's own error is what the person must see
        return signals

    def replace(self, rank: int, plan: LaunchPlan, timeout: float = 120.0) -> ChildProcess:
        """Its host's agent starts a new process in dead rank ``rank``'s place (``plan``: the attempt's, every
        rank's), whose output channels connect to the hub again; its exit comes on the host's control channel."""
        dead = self.children[rank]
        host = next(index for index, (first, count) in enumerate(self._shares) if first <= rank < first + count)
        first, count = self._shares[host]
        self._hub.reopen(HubChannels.stream(rank, stream) for stream in STREAMS)
        dead.control.codes.pop(dead.local_index, None)
        self._hub.collect(time.monotonic() + timeout,
                          [self._agents[host].replace.remote(dead.local_index, plan.part(first, count),
                                                              self._hub.handshake)], self._ray)
        self.children[rank] = RayChild(rank, dead.host,
                                       self._hub.connected[HubChannels.stream(rank, "stdout")].fileno(),
                                       self._hub.connected[HubChannels.stream(rank, "stderr")].fileno(),
                                       dead.control, dead.local_index)
        return self.children[rank]

    def stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Each host's agent signals its ranks and reads their dumps there (stacks.py)."""
        dumps: dict[int, str] = {}
        try:
            for found in self._ray.get([agent.stacks.remote(list(ranks)) for agent in self._agents],
                                       timeout=AUTOPSY_PATIENCE):
                dumps.update(found)
        except Exception:  # noqa: BLE001 - a host that does not answer: its ranks show as not answering
            pass
        return dumps

    def __enter__(self) -> "RayProcessGroup":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """This attempt's processes are stopped and reaped on every host. The agents stay for a
        restart (RayLaunch.release ends them); one that does not answer is killed now."""
        if self._closed:
            return
        self._closed = True
        try:
            ending = [agent.end_ranks.remote() for agent in self._agents]
            done, _ = self._ray.wait(ending, num_returns=len(ending), timeout=SHUTDOWN_PATIENCE)
            for agent, ref in zip(self._agents, ending):
                try:
                    if ref not in done:
                        raise TimeoutError
                    self._ray.get(ref)
                except Exception:  # noqa: BLE001 - its host is gone, or it hangs: its ranks' lifelines break with it
                    self._ray.kill(agent)
        finally:
            self._hub.close()


def start_agents(ray: Any, reservation: Reservation) -> tuple[list, list[dict]]:
    """One agent actor in each host's bundle; returns them with what each reports of its host."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote_agent = ray.remote(HostAgent)
    agents = [
        remote_agent.options(
            num_cpus=0,
            num_gpus=share.ranks,
            max_concurrency=1,  # see agent.py: ranks start from the actor's main thread
            scheduling_strategy=PlacementGroupSchedulingStrategy(reservation.group, placement_group_bundle_index=index),
        ).remote()
        for index, share in enumerate(reservation.shares)
    ]
    try:
        hosts = ray.get([agent.describe.remote() for agent in agents], timeout=120)
    except BaseException:
        for agent in agents:
            ray.kill(agent)
        raise
    return agents, hosts


class RayLaunch:
    """One run's hold on the cluster: planned hosts, reserved GPUs, an agent on each host.

    Built before anything is started, so an infeasible request fails at once (and a busy
    cluster after ``placement_timeout``) with nothing launched. :meth:`release` is
    idempotent and safe whatever happened; a started :class:`RayProcessGroup` releases too.
    """

    def __init__(self, ray: Any, shares: Sequence[HostShare], placement_timeout: float, nodes: Callable[[], list[Node]]):
        self.ray = ray
        self.nodes = nodes
        self.worker_agents: list = []
        self.worker_agent_of: list = []  # data worker w's agent
        self.worker_layout = ""
        self.agents: list = []
        self.kernel_address = ray.util.get_node_ip_address()
        self._hold(shares, placement_timeout)

    def _hold(self, shares: Sequence[HostShare], placement_timeout: float) -> None:
        """Reserve the planned hosts' GPUs and start an agent on each; raises holding nothing."""
        self.shares = list(shares)
        self.reservation = Reservation(self.ray, shares, placement_timeout, self.nodes)
        try:
            self.agents, self.hosts = start_agents(self.ray, self.reservation)
            self.master_addr = self.hosts[0]["address"]
            self.master_port = self.ray.get(self.agents[0].reserve_master_port.remote(), timeout=60)
        except BaseException:
            self.release()
            raise

    def lost_hosts(self) -> list[str]:
        """The planned hosts whose agent no longer answers (the host, or its raylet, went away)."""
        asked = [agent.describe.remote() for agent in self.agents]
        lost = []
        for share, ref in zip(self.shares, asked):
            try:
                self.ray.get(ref, timeout=LOST_HOST_PATIENCE)
            except Exception:  # noqa: BLE001 - whatever Ray says, that host cannot run its ranks now
                lost.append(share.node.label)
        return lost

    def replace(self, shares: Sequence[HostShare], placement_timeout: float) -> None:
        """Let go of the ranks' hosts (not the data workers') and hold ``shares`` instead."""
        self._release_ranks()
        self._hold(shares, placement_timeout)

    def rank_agents(self) -> list:
        """Rank r's agent, by r (the courier's view of where the ranks are now)."""
        return [agent for agent, share in zip(self.agents, self.shares) for _ in range(share.ranks)]

    @property
    def slots(self) -> list[RankSlot]:
        return [
            RankSlot(share.first_rank + local, local, share.ranks, share.group_rank)
            for share in self.shares for local in range(share.ranks)
        ]

    @property
    def has_cuda(self) -> bool:
        """Every host has real CUDA devices for its ranks (a declared "GPU" may be a label only)."""
        return all(host["cuda_devices"] >= share.ranks for host, share in zip(self.hosts, self.shares))

    def host_gpu_ids(self, rank: int) -> str:
        share = next(s for s in self.shares if s.first_rank <= rank < s.first_rank + s.ranks)
        return ",".join(self.hosts[self.shares.index(share)]["gpu_ids"])

    def layout(self) -> str:
        return ", ".join(
            f"ranks {s.first_rank}-{s.first_rank + s.ranks - 1} on {s.node.label}"
            if s.ranks > 1
            else f"rank {s.first_rank} on {s.node.label}"
            for s in self.shares
        )

    def start(self, plan: LaunchPlan, key: bytes) -> RayProcessGroup:
        hosts = [
            (agent, plan.part(share.first_rank, share.ranks), share.node.label)
            for agent, share in zip(self.agents, self.shares)
        ]
        return RayProcessGroup.start(self.ray, hosts, self.kernel_address, key)

    def start_workers(self, plan: LaunchPlan, key: bytes, dirs: tuple[str, ...]) -> RayProcessGroup:
        """The data workers, on CPU-only hosts when the cluster has any, each host's started by
        an agent there (as ranks are); ``dirs`` is the data cache, made on those hosts."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        blocks = worker_blocks(self.nodes(), plan.world_size)
        remote_agent = self.ray.remote(HostAgent)
        hosts = []
        for node, workers in blocks:
            agent = remote_agent.options(
                num_cpus=0, max_concurrency=1,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            ).remote()
            self.worker_agents.append(agent)
            envs, places = [plan.envs[w] for w in workers], [plan.places[w] for w in workers]
            hosts.append((agent, LaunchPlan(len(workers), envs, plan.cwd, plan.handshake, places), node.label))
            self.worker_agent_of.extend([agent] * len(workers))
        self.worker_layout = ", ".join(
            (f"workers {ws[0]}-{ws[-1]}" if len(ws) > 1 else f"worker {ws[0]}") + f" on {node.label}" for node, ws in blocks
        )
        return RayProcessGroup.start(self.ray, hosts, self.kernel_address, key, command=WORKER_COMMAND, dirs=dirs)

    def courier(self, ram_budget: int) -> RayCourier:
        return RayCourier(self.ray, self.rank_agents, self.worker_agent_of, ram_budget)

    def release(self) -> None:
        for agent in self.worker_agents:
            try:
                self.ray.kill(agent)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._release_ranks()

    def _release_ranks(self) -> None:
        for agent in self.agents:
            try:
                self.ray.kill(agent)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.agents = []
        self.reservation.release()
