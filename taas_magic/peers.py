"""Who is on the other end of a channel: a rank or a data worker, by index.

Runs wherever it is imported (pure values): in the kernel, on a run's own thread (supervision, the
relay, the data plane), and in a Ray host agent or Slurm task, which numbers its hub channels with
:class:`HubChannels` and :class:`StepChannels`.

The kernel talks to both kinds of process over one listener. On the wire each proves a
number in its hello (wire.py); :class:`PeerIds` is the one place that says what those
numbers mean: ranks ``0..N-1``, then data workers ``N..N+M-1``. Everything above the
wire (supervisor, relay, the data plane) speaks in :class:`Peer` values and never does
arithmetic on the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

RANK = "rank"
WORKER = "worker"
STREAMS = ("stdout", "stderr")


@dataclass(frozen=True)
class Peer:
    kind: str  # RANK or WORKER
    index: int  # the rank's RANK, or the worker's number

    @property
    def is_rank(self) -> bool:
        return self.kind == RANK

    def __str__(self) -> str:
        return f"{self.kind} {self.index}"


@dataclass(frozen=True)
class PeerIds:
    """The numbering of one run's peers on the wire."""

    ranks: int
    workers: int = 0

    def __len__(self) -> int:
        return self.ranks + self.workers

    def peer(self, wire_id: int) -> Peer:
        if not 0 <= wire_id < len(self):
            raise ValueError(f"no peer {wire_id} in a run of {self.ranks} ranks and {self.workers} workers")
        return Peer(RANK, wire_id) if wire_id < self.ranks else Peer(WORKER, wire_id - self.ranks)

    def wire_id(self, peer: Peer) -> int:
        return peer.index if peer.is_rank else self.ranks + peer.index

    def all(self) -> list[Peer]:
        return [self.peer(wire_id) for wire_id in range(len(self))]


@dataclass(frozen=True)
class HubChannels:
    """The numbering of the cluster's output hub channels (launch/hosts/outputhub.py, launch/hosts/agent.py):
    each rank's stdout and stderr, then one control channel per host."""

    ranks: int
    hosts: int

    def __len__(self) -> int:
        return len(STREAMS) * self.ranks + self.hosts

    @staticmethod
    def stream(rank: int, stream: str) -> int:
        return len(STREAMS) * rank + STREAMS.index(stream)

    def control(self, host: int) -> int:
        return len(STREAMS) * self.ranks + host


@dataclass(frozen=True)
class StepChannels:
    """The Slurm engine's hub channels for a step of ``tasks`` tasks (launch/slurm/): each rank's stdout and stderr, then each
    task's exit channel (launch/hosts/agent.py's control channel), then each task's command channel."""

    tasks: int

    def __len__(self) -> int:
        return (len(STREAMS) + 2) * self.tasks

    @staticmethod
    def stream(rank: int, stream: str) -> int:
        return len(STREAMS) * rank + STREAMS.index(stream)

    def exits(self, task: int) -> int:
        return len(STREAMS) * self.tasks + task

    def command(self, task: int) -> int:
        return (len(STREAMS) + 1) * self.tasks + task
