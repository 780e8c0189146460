"""A registered loader in an exported job (taas_magic/export/jobfeed.py): each rank gets, pass by pass, exactly the
elements a cell's rank gets from taas's data workers; the workers' own sources (feed/extract.py) and the kernel's
coordinator (feed/coordinator.py) are run here in one process as the reference."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from taas_magic.errors import DataPlanError
from taas_magic.export.job import Job
from taas_magic.export.jobfeed import job_feed
from taas_magic.feed.coordinator import FeedCoordinator
from taas_magic.feed.extract import make_source
from taas_magic.feed.plan import FeedTerms, plan_feed
from taas_magic.protocol import Elements, End, Exhausted, Ready, Want


def JobFeed(loader, rank: int, world: int, workers: int, units: int | None, seed: int, name: str = ""):  # noqa: N802
    """The job's feed of ``loader`` for ``rank`` of ``world`` (export/jobfeed.py's ``job_feed``, as ``Job.feed`` makes it)."""
    return job_feed(loader, rank, FeedTerms(units, world, workers, seed, ahead=1), name)


def shuffled(size: int = 16, batch_size: int | None = 2) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(size)), batch_size=batch_size, shuffle=True)


class Counting(IterableDataset):
    """0, 1, ..., size - 1, in order, every time it is read."""

    def __init__(self, size: int):
        self.size = size

    def __iter__(self):
        return iter(torch.arange(self.size).split(1))


class Sized(Counting):
    """:class:`Counting` with a ``len``: one pass has a known size."""

    def __len__(self) -> int:
        return self.size


def flat(elements) -> list[int]:
    """Elements (batches of a TensorDataset, or tensors) as the ints in them, in order."""
    out = []
    for element in elements:
        tensor = element[0] if isinstance(element, (list, tuple)) else element
        out += [int(x) for x in torch.as_tensor(tensor).reshape(-1)]
    return out


def as_the_workers_feed(loader, ranks: int, workers: int, units: int | None, seed: int, passes: int) -> list[list[list[int]]]:
    """What each rank of a cell receives, pass by pass (``[pass][rank]``): the workers' sources extract every fresh
    pass (an iterable's by one worker, in order), the coordinator hands them out; locations name the elements."""
    plan = plan_feed(0, "loader", loader, FeedTerms(units, ranks, workers, seed, ahead=10**6))
    coordinator, made = FeedCoordinator([plan]), {}
    fresh = 0
    while fresh < (plan.fresh_passes if plan.pass_length is not None and plan.kind == "map" else passes):
        stop = False
        for worker in range(workers):
            source = make_source(plan, loader, worker)
            source.start_pass(fresh)
            if plan.kind == "map":
                while (picked := source.next_index()) is not None:
                    j, index = picked
                    made[f"p{fresh}", j] = source.fetch(index)
                    coordinator.on_worker(worker, Ready(0, fresh, j, f"p{fresh}", j))
                continue
            n = 0
            while True:
                try:
                    made[f"p{fresh}", n] = source.next_element()
                except StopIteration:
                    break
                sent = coordinator.on_worker(worker, Ready(0, fresh, None, f"p{fresh}", n))
                n += 1
                stop = stop or any(type(s.frame).__name__ == "Stop" for s in sent)
                if stop:
                    break
            if not stop:
                sent = coordinator.on_worker(worker, Exhausted(0, fresh))
                stop = any(type(s.frame).__name__ == "Stop" for s in sent)
        fresh += 1
        if stop:
            break
    got = []
    for number in range(passes):
        this = []
        for rank in range(ranks):
            sends = coordinator.on_rank(rank, Want(0, number, 10**6))
            assert any(isinstance(s.frame, End) for s in sends if s.to.is_rank and s.to.index == rank)
            places = [place for s in sends if s.to.is_rank and s.to.index == rank and isinstance(s.frame, Elements)
                      for place in s.frame.places]
            this.append(flat(made[place] for place in places))
        got.append(this)
    return got


def as_the_job_feeds(loader, ranks: int, workers: int, units: int | None, seed: int, passes: int) -> list[list[list[int]]]:
    """What each rank of the job gets, pass by pass; each pass as long as ``len`` said before it (where it can)."""
    feeds = [JobFeed(loader, rank, ranks, workers, units, seed) for rank in range(ranks)]
    got = []
    for _ in range(passes):
        this = []
        for feed in feeds:
            try:
                length = len(feed)
            except TypeError:  # an iterable without len, before its fresh pass is read
                length = None
            elements = list(feed)
            assert length in (None, len(elements))
            this.append(flat(elements))
        got.append(this)
    return got


@pytest.mark.parametrize(("size", "batch", "units", "ranks"), [
    (16, 2, None, 2),  # one pass each time, reshuffled
    (17, None, None, 3),  # unbatched; 17 over 3 ranks: 5 each, 2 dropped
    (16, 2, 6, 2),  # --units 6 of 8 batches: then the cached 6 replayed, reshuffled
    (15, 3, 13, 2),  # --units 13 of 5 batches a pass: 2 fresh passes (5, then 8 cut to 8), replays
], ids=["one-pass", "unbatched-remainder", "units-under-a-pass", "units-over-passes"])
def test_a_map_style_loader_gives_each_rank_what_the_data_workers_give_it(size, batch, units, ranks):
    loader = shuffled(size, batch)
    expected = as_the_workers_feed(loader, ranks, 2, units, seed=7, passes=5)
    assert as_the_job_feeds(loader, ranks, 0, units, seed=7, passes=5) == expected
    assert expected[0] != expected[1]  # passes are reshuffled: the comparison sees the order


@pytest.mark.parametrize(("size", "units", "ranks"), [(9, None, 2), (10, 25, 3), (8, 5, 2)],
                         ids=["one-pass-remainder", "units-over-passes", "units-under-a-pass"])
def test_an_iterable_gives_each_rank_what_one_data_worker_gives_it(size, units, ranks):
    loader = DataLoader(Sized(size) if units is None else Counting(size), batch_size=None)
    expected = as_the_workers_feed(loader, ranks, 1, units, seed=0, passes=5)
    assert as_the_job_feeds(loader, ranks, 0, units, seed=0, passes=5) == expected


def test_the_ranks_share_one_order_the_sampler_seeded_with_the_seed():
    loader = shuffled()
    first, second = (flat(JobFeed(loader, rank, 2, 0, None, seed=5)) for rank in range(2))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        order = list(loader.batch_sampler)
    assert first == [i for batch in order[0::2] for i in batch]
    assert second == [i for batch in order[1::2] for i in batch]
    feed = JobFeed(shuffled(), 0, 1, 0, None, seed=5)
    first, again = flat(feed), flat(feed)  # one pass is all --units takes: the next one replays it, reshuffled
    assert sorted(first) == sorted(again) == list(range(16)) and first != again


def test_uneven_passes_never_reach_the_ranks():
    """DDP waits forever on a rank with one step more: 5 elements over 2 ranks is 2 each, as in a cell."""
    loader = DataLoader(TensorDataset(torch.arange(5)), batch_size=None)
    ranks = [JobFeed(loader, rank, 2, 0, None, seed=0) for rank in range(2)]
    assert [len(feed) for feed in ranks] == [2, 2]
    assert [flat(feed) for feed in ranks] == [[0, 2], [1, 3]]
    assert flat(JobFeed(loader, 0, 2, 1, None, seed=0)) == [0, 2]  # a DataLoader worker process of this rank


def test_a_plain_sequence_and_a_plain_iterable_are_fed_as_a_cell_feeds_them():
    assert list(JobFeed([10, 11, 12, 13, 14], 1, 2, 0, None, seed=0)) == [11, 13]  # map-style: len and [i]
    feed = JobFeed(Counting(5), 0, 2, 0, 4, seed=0)  # no len: --units; groups [0, 1], [2, 3]
    assert [flat(feed) for _ in range(3)] == [[0, 2]] * 3  # read once, then replayed


def test_a_loader_a_cell_would_refuse_is_refused_in_the_job_with_the_cells_words():
    with pytest.raises(DataPlanError, match="fewer than the 4 ranks"):
        JobFeed([1, 2, 3], 0, 4, 0, None, seed=0)
    with pytest.raises(DataPlanError, match=r"taas: stream \(Counting\) has no len\(\).*give --units K"):
        JobFeed(Counting(4), 0, 2, 0, None, seed=0, name="stream")  # the notebook's name, as the script gives it


def test_feed_shares_the_cpus_among_the_ranks():
    made = [Job("/j/t.py", rank=1, world=2).feed([1, 2, 3], cpus=cpus, units=4, seed=9) for cpus in (5, 1)]
    assert [(feed.rank, feed.plan.ranks, feed.plan.workers, feed.plan.units, feed.plan.seed) for feed in made] == [
        (1, 2, 2, 4, 9), (1, 2, 0, 4, 9)]
