"""Prepared elements between Slurm nodes, through the kernel (the Ray engine's go through Ray's
object store: launch/ray/courier.py).

Runs in the kernel, on the run's own thread with the supervisor; the Slurm tasks
(launch/slurm/task.py) publish and mirror the records.

The coordinator names an element by where a data worker stored it (segment path and offset on
the worker's node). A rank on that same node reads it there, as in the local mode. For a rank
on another node, the kernel first asks the worker's task for the record (``publish``), then the
rank node's first task to store it in its node's cache (``mirror``, RAM then disk, as the local
mode does), and hands the rank that address. Each node copies an element once: the node's
other ranks, and replayed passes, reuse it. A copy is synchronous on the supervisor's thread
(two command round trips per batch), so a delivery is never sent ahead of its elements.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

from taas_magic.errors import RunError
from taas_magic.feed.coordinator import Send
from taas_magic.launch.slurm.step import SlurmStep
from taas_magic.protocol import Elements

COPY_PATIENCE = 60.0  # seconds one batch of records may take to travel between two nodes


class SlurmCourier:
    """Moves prepared elements from the data workers' nodes to each rank's node."""

    busy = False  # every copy completes inside route()

    def __init__(self, ranks: Callable[[], SlurmStep | None], workers: SlurmStep, ram_budget: int,
                 say: Callable[[str], None]):
        self._ranks = ranks  # the current attempt's step (a restart makes a new one)
        self._workers = workers
        self.ram_budget = ram_budget
        self._say = say  # once, at the first copy: the cell says elements travel between nodes
        self.copies: dict[tuple[str, str, int], tuple[str, int]] = {}  # (node, path, offset) -> there
        self.copied = 0  # records moved between nodes, for the tests and the curious

    def restart_ranks(self) -> None:
        """A new step's tasks hold new node caches: what the old ones copied is gone with them."""
        self.copies.clear()

    def ready(self) -> list[Send]:
        return []

    def route(self, sends: list[Send]) -> list[Send]:
        """Each delivery with its elements' addresses on the rank's node."""
        out = []
        for send in sends:
            if send.to.is_rank and isinstance(send.frame, Elements):
                places = self._places(send.to.index, list(send.frame.places))
                send = dataclasses.replace(send, frame=dataclasses.replace(send.frame, places=places))
            out.append(send)
        return out

    def _places(self, rank: int, places: list[tuple[str, int]]) -> list[tuple[str, int]]:
        step = self._ranks()
        if step is None:
            return places
        node = step.nodes()[rank]
        worker_nodes = self._workers.nodes()
        missing = [(path, offset) for path, offset in places
                   if worker_nodes[_worker_of(path)] != node and (node, path, offset) not in self.copies]
        if missing:
            self._copy(step, node, missing)
        return [self.copies.get((node, path, offset), (path, offset)) for path, offset in places]

    def _copy(self, step: SlurmStep, node: str, missing: list[tuple[str, int]]) -> None:
        by_worker: dict[int, list[tuple[str, int]]] = {}
        for path, offset in missing:
            by_worker.setdefault(_worker_of(path), []).append((path, offset))
        records: list[str] = []
        keys: list[tuple[str, int]] = []
        for worker, wanted in by_worker.items():
            answer = self._workers.ask(worker, {"do": "publish", "places": wanted}, COPY_PATIENCE)
            if answer is None or len(answer.get("records", [])) != len(wanted):
                raise RunError(f"taas: data worker {worker} on {self._workers.nodes()[worker]} did not hand over its "
                               "prepared elements; every rank was stopped.")
            records += answer["records"]
            keys += wanted
        keeper = min(task for task, where in enumerate(step.nodes()) if where == node)  # the node's first task
        answer = step.ask(keeper, {"do": "mirror", "ram": self.ram_budget, "records": records}, COPY_PATIENCE)
        if answer is None or len(answer.get("places", [])) != len(keys):
            raise RunError(f"taas: rank {keeper}'s task on {node} could not store the prepared elements sent to "
                           "it; every rank was stopped.")
        self.copies.update({(node, path, offset): (there, at) for (path, offset), (there, at) in zip(keys, answer["places"])})
        if not self.copied:
            self._say(f"taas: data: prepared elements travel from the workers' nodes to {node} and the ranks' other "
                      "nodes through the kernel, each copied once per node")
        self.copied += len(keys)


def _worker_of(path: str) -> int:
    """Data worker w writes segments named ``w<w>-<n>.seg`` (feed/segments.py)."""
    return int(os.path.basename(path)[1:].split("-", 1)[0])
