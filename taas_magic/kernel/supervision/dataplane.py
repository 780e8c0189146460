"""The data side of one run, set up by the kernel before any process starts.

Runs in the kernel: :class:`DataRun` is made on the cell's thread by the plan step (kernel/runs/runplan.py),
prepared and started on the run's own thread (kernel/runs/execution.py). Given the registered loaders the
cell's closure reached and the run's settings, it makes their plans (``--units`` checked here, before
anything is launched), pickles each loader once (the same bytes go to the workers and, for
``loader.dataset`` and friends, to the ranks), makes the cache directories and the workers' launch plan
(``prepare``), with the environment and write rule of a rank other than 0, minus any GPU. The run's
backend starts the workers (launch/contract.py's ``start_workers``, and on a cluster its ``courier``);
:meth:`DataRun.start` then makes the kernel's side of them, the :class:`DataPlane`.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from taas_magic import protocol, wire
from taas_magic.cell.pragma import RunSettings
from taas_magic.feed.coordinator import FeedCoordinator
from taas_magic.feed.plan import FeedTerms, loader_kind, plan_feed
from taas_magic.feed.progress import ProgressLine
from taas_magic.feed.segments import SEGMENT_BYTES, CacheDirs
from taas_magic.launch.contract import Courier, LaunchPlan, ProcessGroup
from taas_magic.output.relay import Publish
from taas_magic.peers import WORKER, Peer, PeerIds
from taas_magic.procs import OWNER_VARIABLE
from taas_magic.runspec import FeedPlan, RankFeed
from taas_magic.tempdirs import ram_root
from taas_magic.transfer import pickler
from taas_magic.writes.rule import WriteRule

MIN_SEGMENT_BYTES = 1 << 20
DEFAULT_CACHE_RAM = 4 << 30


@dataclass
class DataPlane:
    """The data workers of a run and the kernel's side of their element stream."""

    coordinator: FeedCoordinator
    workers: ProcessGroup  # worker w is ``workers.children[w]``, peer id N + w
    progress: ProgressLine
    usage: Callable[[], tuple[int, int]]  # the cache's bytes in RAM and on disk, now
    courier: Courier | None = None  # a cluster's backend: carries elements to the ranks' hosts

    def restart_ranks(self) -> None:
        """The ranks start again (--restarts): they read from the beginning, served from the cache;
        what the workers prepared stays, and they go on from where they were."""
        self.coordinator.restart_ranks()
        if self.courier is not None:
            self.courier.restart_ranks()


def default_cache_ram() -> int:
    """4 GiB, or half of what the RAM directory has free if that is less."""
    try:
        stats = os.statvfs(ram_root())
        free = stats.f_bavail * stats.f_frsize
    except OSError:
        return DEFAULT_CACHE_RAM
    return min(DEFAULT_CACHE_RAM, free // 2)


def notebook_name(loader: Any, user_ns: Mapping[str, Any]) -> str:
    for name, value in user_ns.items():
        if value is loader and not name.startswith("_"):
            return name
    return f"a registered {type(loader).__name__}"


def describe_registered(loader: Any, user_ns: Mapping[str, Any]) -> str:
    """``train_loader (DataLoader, map, 938 per pass)``, for ``%taas status``."""
    kind, length, _ = loader_kind(loader)
    size = f"{length} per pass" if length is not None else "no len"
    return f"{notebook_name(loader, user_ns)} ({type(loader).__name__}, {kind}, {size})"


class DataRun:
    def __init__(self, loaders: Mapping[int, Any], user_ns: Mapping[str, Any], settings: RunSettings):
        """The plans of ``loaders`` (by feed id; ``user_ns`` names them) on the run's ``--units``,
        ``--gpus`` (ranks), ``--cpus`` (workers) and ``--ahead``, with a new seed; ``--cache-ram``
        unset is :func:`default_cache_ram`."""
        terms = FeedTerms(settings.units, settings.gpus, settings.cpus, secrets.randbits(31), settings.ahead)
        self.workers = terms.workers
        self.cache_ram = settings.cache_ram if settings.cache_ram is not None else default_cache_ram()
        self.plans: list[FeedPlan] = [
            plan_feed(feed, notebook_name(loader, user_ns), loader, terms) for feed, loader in loaders.items()
        ]
        self.originals = {feed: pickler.dumps(loader) for feed, loader in loaders.items()}
        self.seed = terms.seed
        self.dirs: CacheDirs | None = None

    def rank_feeds(self) -> tuple[RankFeed, ...]:
        """What each rank needs to build its prepared loaders (``spec.feeds``)."""
        return tuple(RankFeed(plan, self.originals[plan.feed]) for plan in self.plans)

    def header(self) -> str:
        plural = "s" if self.workers != 1 else ""
        return f"data: {self.workers} worker{plural} prepare " + "; ".join(plan.describe() for plan in self.plans)

    def segment_bytes(self) -> int:
        share = self.cache_ram // self.workers
        return max(MIN_SEGMENT_BYTES, min(SEGMENT_BYTES, share // 4))

    def greeting(self, worker: int) -> list[bytes]:
        assert self.dirs is not None
        job = protocol.Job(worker, self.workers, self.seed, self.plans, (self.dirs.ram, self.dirs.disk),
                           self.cache_ram // self.workers, self.segment_bytes(), list(sys.path))
        return [protocol.encode(job), protocol.encode(protocol.Loaders(self.originals))]

    def prepare(self, run_id: str, handshake: str, peers: PeerIds, layers: Mapping[int, str],
                rule: WriteRule) -> LaunchPlan:
        """Make the cache directories, and the workers' launch plan: each one's environment (``peers``
        numbers them on the wire; ``layers``: a worker's scratch layer, where the write ``rule`` isolates it)."""
        self.dirs = CacheDirs.create(run_id)
        envs, places = [], []
        for worker in range(self.workers):
            env = dict(os.environ)
            env.update(
                CUDA_VISIBLE_DEVICES="",  # data workers prepare on CPU; GPUs belong to the ranks
                OMP_NUM_THREADS="1",  # as torch sets in DataLoader workers
            )
            env[OWNER_VARIABLE] = f"{os.getpid()}-{run_id}-data"  # what it starts is found and ended with the run
            place = wire.Placement(peers.wire_id(Peer(WORKER, worker)), f"data worker {worker}")
            if worker in layers and not self._cache_inside(rule.repository):
                place = dataclasses.replace(place, repository=rule.repository, layer=layers[worker], write_mode=rule.mode)
            envs.append(env)
            places.append(place)
        return LaunchPlan(self.workers, envs, os.getcwd(), handshake, places)

    def start(self, workers: ProcessGroup, courier: Courier | None, publish: Publish) -> DataPlane:
        """The kernel's side of the started ``workers`` (the backend started them with :meth:`prepare`'s
        plan and the cache directories; ``courier``: what carries their elements to the ranks' hosts,
        on a cluster); ``publish`` shows the data line in the cell."""
        coordinator = FeedCoordinator(self.plans)
        progress = ProgressLine(coordinator, publish, self.workers)
        return DataPlane(coordinator, workers, progress, self.usage, courier)

    def cache_dirs(self) -> tuple[str, ...]:
        """The cache directories (RAM, disk) :meth:`prepare` made."""
        assert self.dirs is not None, "prepare makes the cache directories first"
        return self.dirs.ram, self.dirs.disk

    def _cache_inside(self, repository: str) -> bool:
        """A cache directory inside the repository cannot be isolated away from the workers."""
        assert self.dirs is not None
        root = os.path.join(os.path.realpath(repository), "")
        return any(os.path.realpath(path).startswith(root) for path in (self.dirs.ram, self.dirs.disk))

    def usage(self) -> tuple[int, int]:
        return self.dirs.usage() if self.dirs is not None else (0, 0)

    def close(self) -> None:
        if self.dirs is not None:
            self.dirs.remove()
