"""A registered loader in an exported job: each rank's share of each pass, by the data workers' own rule.

Runs in a job's rank, on its main thread (the script's ``_taas.feed(loader, ...)``: export/job.py).

The job has no data workers in the kernel, but its ranks see what a cell's ranks see, because the rule is the feed's,
imported, not restated: the plan is feed/plan.py's (``plan_feed``: the same refusals, ``--units`` K in all, the same
seed), its arithmetic runspec.py's :class:`FeedPlan`:

- a map-style loader: fresh pass ``p`` is the loader's own sampler under ``seed + p`` (feed/extract.py's
  :func:`pass_indices`), cut to ``fresh_length(p)`` (K reached, and a multiple of the ranks: DDP never waits on
  uneven inputs); once K elements are out, a pass replays the fresh passes in turn, in the order
  :meth:`FeedPlan.replay_order` draws;
- an iterable: read in order (this rank reads it all; taas's workers would share it), a fresh pass cut at K and
  at a multiple of the ranks, replayed in turn after;
- rank ``r`` of ``N`` takes elements ``j`` with ``j % N == r``, prepared by ``workers`` DataLoader workers of its own.
"""

from __future__ import annotations

import sys
from typing import Any, Iterator, cast

from taas_magic.feed.extract import MapSource, pass_indices
from taas_magic.feed.plan import FeedTerms, plan_feed
from taas_magic.runspec import MAP, FeedPlan, delivered_length


class _Elements:
    """Elements of a map-style loader by position, fetched as the data workers fetch them (feed/extract.py's
    :class:`MapSource`: a DataLoader's own fetcher and collate, a plain sequence's items)."""

    def __init__(self, source: MapSource, indices: list[Any]):
        self.source, self.indices = source, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> Any:
        return self.source.fetch(self.indices[position])


def job_feed(loader: Any, rank: int, terms: FeedTerms, name: str = "") -> JobFeed:
    """``loader`` as rank ``rank`` sees it in a job: planned as a cell's registered loader is, on ``terms`` (its
    ranks, workers, ``--units``, seed); ``name``, the notebook's name for it, is what a refusal says.

    Raises:
        DataPlanError: as a cell would: no ``len`` and no ``units``, or fewer elements than ranks.
    """
    return JobFeed(loader, rank, plan_feed(0, name or type(loader).__name__, loader, terms))


class JobFeed:
    """A registered loader as rank ``rank`` of ``plan.ranks`` sees it in a job (see the module docstring)."""

    def __init__(self, loader: Any, rank: int, plan: FeedPlan):
        self.loader, self.rank, self.plan = loader, rank, plan
        self._source = MapSource(plan, loader, 0) if plan.kind == MAP else None  # only its fetch is used
        self.passes = 0  # passes begun
        self._fresh: list[list[Any]] = []  # an iterable's fresh passes, this rank's share of each, for the replays
        self._extracted = 0  # an iterable's elements read so far
        self._fresh_done = False  # an iterable: K read, or a pass gave nothing; every pass after replays

    @property
    def world(self) -> int:
        return self.plan.ranks

    def __len__(self) -> int:
        """This rank's elements in its next pass (an iterable's fresh pass: once read, or from its ``len``)."""
        if self.plan.kind == MAP:
            return self.plan.fresh_length(self._fresh_pass_of(self.passes)) // self.world
        if self._fresh_done:
            return len(self._replay(self.passes))
        if self.plan.pass_length is None:
            raise TypeError(f"{type(self.loader).__name__} has no len() before its pass is read")
        return delivered_length(min(self.plan.pass_length, self.plan.units - self._extracted), self.world) // self.world

    def __iter__(self) -> Iterator[Any]:
        number, self.passes = self.passes, self.passes + 1
        if self.plan.kind == MAP:
            return self._map_pass(number)
        fresh = None if self._fresh_done else self._read_fresh()
        return iter(fresh if fresh is not None else self._replay(number))

    def _fresh_pass_of(self, number: int) -> int:
        fresh = self.plan.fresh_passes
        return number if number < fresh else (number - fresh) % fresh

    def _map_pass(self, number: int) -> Iterator[Any]:
        fresh = self._fresh_pass_of(number)
        indices = self._indices(fresh)[:self.plan.fresh_length(fresh)]
        order = None if number == fresh else self.plan.replay_order(number, len(indices))
        if order is not None:
            indices = [indices[k] for k in order]
        import torch

        assert self._source is not None
        mine = _Elements(self._source, indices[self.rank::self.world])
        yield from torch.utils.data.DataLoader(cast(Any, mine), batch_size=None, num_workers=self.plan.workers)

    def _indices(self, fresh: int) -> list[Any]:
        data = sys.modules.get("torch.utils.data")
        if data is not None and isinstance(self.loader, data.DataLoader):
            return pass_indices(self.loader, self.plan.seed, fresh)
        return list(range(len(self.loader)))

    def _read_fresh(self) -> list[Any] | None:
        """One fresh pass of an iterable read to its end or to K, whole groups of N only, this rank's share kept
        (and returned); None where the pass gave no whole group (the fresh passes end there, as the workers' do)."""
        group: list[Any] = []
        mine: list[Any] = []
        for element in self.loader:
            self._extracted += 1
            group.append(element)
            if len(group) == self.world:  # a whole group of N: each rank takes its own
                mine.append(group[self.rank])
                group = []
            if self._extracted >= self.plan.units:
                self._fresh_done = True
                break
        if not mine and not self._fresh_done:
            self._fresh_done = True
            return None
        self._fresh.append(mine)
        return mine

    def _replay(self, number: int) -> list[Any]:
        """Pass ``number`` once the fresh passes are read: they replayed in turn (an iterable does not shuffle)."""
        return self._fresh[(number - len(self._fresh)) % len(self._fresh)] if self._fresh else []
