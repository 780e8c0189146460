"""Prepared elements between hosts (the cluster mode): from the data workers' hosts to each
rank's host, through Ray's object store.

Runs in the kernel, on the run's own thread, where the supervisor hands it deliveries; the records
are published and mirrored by the Ray host agents (launch/hosts/agent.py).

The local mode hands a rank the address of an element in the workers' cache, which every
process on the host can map. Across hosts that address means nothing on the rank's host,
so the kernel's deliveries pass through a :class:`RayCourier` first.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from taas_magic.errors import RunError
from taas_magic.feed.coordinator import Send
from taas_magic.protocol import Elements, End


class RayCourier:
    """Moves prepared elements from the data workers' hosts to each rank's host through Ray's
    object store, and holds back each delivery until its elements are there.

    The coordinator names elements by where a worker stored them (segment path, offset on
    the worker's host). Before a delivery reaches rank r, every element in it is copied to
    r's host once: the worker host's agent ``publish``es the record (the returned bytes live
    in that node's object store), and the agent of r's host ``mirror``s it (Ray moves the
    object between nodes; the agent appends it to its own cache, RAM then disk), returning
    where r reads it. Copies are kept per host, so replayed passes and other ranks on the
    same host reuse them. A rank's messages leave in the order the coordinator made them.
    """

    def __init__(self, ray: Any, rank_agents: Callable[[], list], worker_agents: list, ram_budget: int):
        self.ray = ray
        self._rank_agents = rank_agents
        self.worker_agents = worker_agents
        self.ram_budget = ram_budget
        self.waiting: dict[int, list] = {}  # rank -> its held-back messages, in order
        self._find_hosts()

    def _find_hosts(self) -> None:
        self.rank_agents = self._rank_agents()
        self.host_agents: list = []  # one per rank host, in rank order
        self.hosts: dict[int, int] = {}  # id(agent) -> its index in host_agents
        for agent in self.rank_agents:
            if id(agent) not in self.hosts:
                self.hosts[id(agent)] = len(self.host_agents)
                self.host_agents.append(agent)
        self.copies: dict[tuple[int, str, int], tuple[str, int]] = {}  # (host, path, offset) -> there
        self.in_flight: dict[Any, list[tuple[int, str, int]]] = {}  # mirror result -> its keys

    def restart_ranks(self) -> None:
        """The ranks start again: deliveries held back for the old processes are dropped (the
        coordinator delivers from the beginning again); copies already on a host are kept,
        unless the ranks moved to other hosts (a host went away)."""
        self.waiting.clear()
        if [id(agent) for agent in self._rank_agents()] != [id(agent) for agent in self.rank_agents]:
            self._find_hosts()

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

    def route(self, sends: list[Send]) -> list[Send]:
        """Sends to pass on now; deliveries wait (in order, per rank) for their copies."""
        out = []
        for send in sends:
            if not send.to.is_rank or not isinstance(send.frame, (Elements, End)):
                out.append(send)
                continue
            if isinstance(send.frame, Elements):
                self._fetch(send.to.index, send.frame.places)
            self.waiting.setdefault(send.to.index, []).append(send)
        return out + self.ready()

    def _fetch(self, rank: int, batch: list[tuple[str, int]]) -> None:
        host = self.hosts[id(self.rank_agents[rank])]
        pending = {key for keys in self.in_flight.values() for key in keys}
        missing = [(host, path, offset) for path, offset in batch
                   if (host, path, offset) not in self.copies and (host, path, offset) not in pending]
        if not missing:
            return
        records = [self.worker_agents[_worker_of(path)].publish.remote(path, offset) for _, path, offset in missing]
        result = self.host_agents[host].mirror.remote(self.ram_budget, *records)
        self.in_flight[result] = missing

    def ready(self) -> list[Send]:
        """Deliveries whose elements have all reached their rank's host, translated."""
        if self.in_flight:
            refs = list(self.in_flight)
            done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in done:
                keys = self.in_flight.pop(ref)
                try:
                    places = self.ray.get(ref)
                except Exception as exc:  # noqa: BLE001 - any Ray failure ends the run the same way
                    raise RunError(
                        f"taas: moving prepared elements between hosts failed: {exc}; every rank was stopped."
                    ) from None
                self.copies.update(zip(keys, places))
        out = []
        for rank, queue in self.waiting.items():
            host = self.hosts[id(self.rank_agents[rank])]
            while queue:
                send = queue[0]
                if isinstance(send.frame, Elements):
                    places = [self.copies.get((host, path, offset)) for path, offset in send.frame.places]
                    if None in places:
                        break
                    send = dataclasses.replace(send, frame=dataclasses.replace(send.frame, places=places))
                out.append(send)
                queue.pop(0)
        return out


def _worker_of(path: str) -> int:
    """Data worker w writes segments named ``w<w>-<n>.seg`` (feed/segments.py)."""
    return int(os.path.basename(path)[1:].split("-", 1)[0])
