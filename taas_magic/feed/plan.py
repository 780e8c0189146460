"""What a registered loader is, and the arithmetic of its passes (kernel, workers, ranks).

Runs in the kernel, in a run's plan step (kernel/supervision/dataplane.py: the cell's thread, or a
search's), and the plans it makes travel in runspec.py's :class:`FeedPlan`, whose arithmetic the
workers and the ranks read.

An *element* is one item the loader yields (a batch for a batched DataLoader). Two kinds:

- ``map``: a DataLoader over a map-style dataset, or any object with ``len`` and
  ``__getitem__``. A pass has ``L = len(loader)`` elements; element ``j`` of a pass is
  the ``j``-th index (batch of indices) the loader's own sampler yields, reseeded per
  pass; worker ``w`` of ``M`` prepares the elements ``j`` with ``j % M == w``.
- ``iterable``: a DataLoader over an ``IterableDataset``, or any other re-iterable. Each
  worker iterates its own copy with ``get_worker_info()`` set as under DataLoader
  workers; elements are numbered in the order they reach the kernel; a pass ends when
  every worker's iterator is exhausted.

The run extracts ``K = --units`` elements: fresh passes follow one another until K
elements are extracted (the last one cut short at K); passes after that replay the
cached fresh passes in turn, in a new order each time if the loader shuffles. Element
``j`` of a pass goes to rank ``j % N``; each rank gets ``D // N`` elements of a pass of
``D`` (the remainder is dropped, so DDP never waits on uneven inputs).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from taas_magic.errors import DataPlanError
from taas_magic.runspec import ITERABLE, MAP, FeedPlan


def loader_kind(loader: Any) -> tuple[str, int | None, bool]:
    """(kind, len or None, shuffles) of a registered object, without importing torch."""
    data = sys.modules.get("torch.utils.data")
    if data is not None and isinstance(loader, data.DataLoader):
        length = _length(loader)
        if isinstance(loader.dataset, data.IterableDataset):
            return ITERABLE, length, False
        sampler = loader.batch_sampler.sampler if loader.batch_sampler is not None else loader.sampler
        return MAP, length, not isinstance(sampler, data.SequentialSampler)
    if hasattr(loader, "__getitem__") and hasattr(loader, "__len__"):
        return MAP, len(loader), False
    return ITERABLE, _length(loader), False


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


@dataclass(frozen=True)
class FeedTerms:
    """What a run asks of every registered loader it reads, the same for each: ``units`` (K,
    ``--units``; None: one pass), the ranks it feeds (N), the data workers that prepare it
    (M, ``--cpus``), the run's seed, and ``ahead`` (``--ahead``)."""

    units: int | None
    ranks: int
    workers: int
    seed: int
    ahead: int


def plan_feed(feed: int, name: str, loader: Any, terms: FeedTerms) -> FeedPlan:
    """The plan for one registered loader the cell uses (``feed``: its id in the run; ``name``:
    the notebook's name for it), read on the run's ``terms``.

    Raises:
        DataPlanError: no ``len`` and no ``--units``, or fewer elements than ranks.
    """
    kind, length, shuffle = loader_kind(loader)
    units, ranks = terms.units, terms.ranks
    if units is None:
        if length is None:
            raise DataPlanError(
                f"taas: {name} ({type(loader).__name__}) has no len(), so one pass has no known size: "
                "give --units K, the number of elements the data workers extract"
            )
        units = length
    if kind == MAP and length is not None and length < ranks:
        raise DataPlanError(f"taas: {name} yields {length} element(s) per pass, fewer than the {ranks} ranks")
    if units < ranks:
        raise DataPlanError(f"taas: --units {units} is fewer than the {ranks} ranks: every rank needs an element")
    return FeedPlan(feed, name, kind, length, units, ranks, terms.workers, shuffle, terms.seed, terms.ahead)
