"""A worker's view of one registered loader: its own elements of each pass.

Runs in each data worker (feed/worker.py), on its main thread.

For a DataLoader this reuses the DataLoader's own machinery, so an element is exactly
what ``for x in loader`` would yield: the loader's index sampler (``_index_sampler``,
batches of indices or single indices) and its dataset fetcher (``dataset[i]`` or
``__getitems__``, then ``collate_fn``). Those are private torch names, used only here.

- :class:`MapSource`: every worker enumerates the same order for pass p (the sampler
  is run under ``torch.manual_seed(seed + p)`` in a forked RNG, so a sampler without a
  generator of its own is reseeded per pass and the dataset's own randomness is not
  disturbed) and prepares only the elements ``j % M == w``.
- :class:`IterableSource`: the worker iterates its copy with torch's worker info set
  (``get_worker_info()`` returns id=w, num_workers=M, as under DataLoader workers), so
  a dataset that shards by worker shards here too; one that does not is read in full
  by every worker, as with DataLoader workers.

Each worker seeds ``random``, torch and numpy as DataLoader workers do (seed + w), so
random augmentations differ between workers.
"""

from __future__ import annotations

import random
import sys
from types import ModuleType
from typing import Any, Iterator

from taas_magic.runspec import MAP, FeedPlan


def seed_worker(seed: int, worker: int) -> None:
    random.seed(seed + worker)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed + worker)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed((seed + worker) % 2**32)


def _data_module() -> ModuleType | None:
    return sys.modules.get("torch.utils.data")


def set_worker_info(loader: Any, worker: int, workers: int, seed: int) -> None:
    """What ``torch.utils.data.get_worker_info()`` returns in this worker, as under DataLoader."""
    data = _data_module()
    if data is None:
        return
    from torch.utils.data._utils import worker as torch_worker  # private API: see taas_magic/private.py

    dataset = loader.dataset if isinstance(loader, data.DataLoader) else loader
    torch_worker._worker_info = torch_worker.WorkerInfo(id=worker, num_workers=workers, seed=seed + worker, dataset=dataset)
    init = getattr(loader, "worker_init_fn", None) if isinstance(loader, data.DataLoader) else None
    if init is not None:
        init(worker)


def pass_indices(loader: Any, seed: int, fresh_pass: int) -> list[Any]:
    """A DataLoader's indices (batches of indices) for fresh pass ``fresh_pass``: its own sampler run under
    ``torch.manual_seed(seed + fresh_pass)`` in a forked RNG (the caller's RNG untouched); the same in every data
    worker, and in an exported job's ranks (export/jobfeed.py)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + fresh_pass)
        return list(loader._index_sampler)


class MapSource:
    """Elements ``j`` with ``j % M == w`` of each fresh pass, ``j < fresh_length(p)``."""

    def __init__(self, plan: FeedPlan, loader: Any, worker: int):
        self.plan, self.loader, self.worker = plan, loader, worker
        data = _data_module()
        self._is_dataloader = data is not None and isinstance(loader, data.DataLoader)
        if self._is_dataloader:
            from torch.utils.data.dataloader import _DatasetKind  # private API: see taas_magic/private.py

            self._fetcher = _DatasetKind.create_fetcher(
                _DatasetKind.Map, loader.dataset, loader._auto_collation, loader.collate_fn, loader.drop_last
            )
        self._order: Iterator[tuple[int, Any]] = iter(())
        self._limit = 0

    def start_pass(self, fresh_pass: int) -> None:
        self._limit = self.plan.fresh_length(fresh_pass)
        if not self._is_dataloader:
            self._order = ((j, j) for j in range(self.worker, self._limit, self.plan.workers))
            return
        indices = pass_indices(self.loader, self.plan.seed, fresh_pass)
        self._order = ((j, indices[j]) for j in range(self.worker, min(self._limit, len(indices)), self.plan.workers))

    def next_index(self) -> tuple[int, Any] | None:
        """(j, the loader's index for it) of this worker's next element of the pass, or None."""
        return next(self._order, None)

    def fetch(self, index: Any) -> Any:
        if self._is_dataloader:
            return self._fetcher.fetch(index)
        return self.loader[index]


class IterableSource:
    """A worker's own stream of one pass; ``next_element`` raises StopIteration at its end."""

    def __init__(self, plan: FeedPlan, loader: Any, worker: int):
        self.plan, self.loader, self.worker = plan, loader, worker
        data = _data_module()
        self._is_dataloader = data is not None and isinstance(loader, data.DataLoader)
        self._next: Any = None

    def start_pass(self, fresh_pass: int) -> None:
        if self._is_dataloader:
            from torch.utils.data.dataloader import _DatasetKind  # private API: see taas_magic/private.py

            loader = self.loader
            fetcher = _DatasetKind.create_fetcher(
                _DatasetKind.Iterable, loader.dataset, loader._auto_collation, loader.collate_fn, loader.drop_last
            )
            indices = iter(loader._index_sampler)
            self._next = lambda: fetcher.fetch(next(indices))
        else:
            iterator = iter(self.loader)
            self._next = lambda: next(iterator)

    def next_element(self) -> Any:
        return self._next()


def make_source(plan: FeedPlan, loader: Any, worker: int) -> MapSource | IterableSource:
    return MapSource(plan, loader, worker) if plan.kind == MAP else IterableSource(plan, loader, worker)
