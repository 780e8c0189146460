"""A data worker's view of one registered loader (feed/extract.py), on real torch DataLoaders over synthetic
TensorDatasets and IterableDatasets, in this process as each worker would run it: every worker of a map-style
loader enumerates the same order of a pass, reseeded per pass without touching the global RNG, and prepares
only its elements ``j % M == w`` up to the pass's delivered length, each element what the DataLoader yields
(its sampler, ``__getitems__``, its ``collate_fn``); an iterable loader is read with ``get_worker_info()``
answering as under DataLoader workers, so a dataset that shards by worker shards here; and each worker's
RNGs are seeded as DataLoader seeds its workers."""

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info
from torch.utils.data._utils import worker as torch_worker

from taas_magic.feed.extract import IterableSource, MapSource, make_source, seed_worker, set_worker_info
from taas_magic.runspec import ITERABLE, MAP, FeedPlan


@pytest.fixture(autouse=True)
def process_state():
    """What the sources set for the whole process (worker info, RNG states) is put back after each test."""
    states = random.getstate(), torch.get_rng_state(), np.random.get_state()
    yield
    torch_worker._worker_info = None
    random.setstate(states[0])
    torch.set_rng_state(states[1])
    np.random.set_state(states[2])


class Sharded(IterableDataset):
    """Numbers 0..n-1, each worker of get_worker_info() taking its own (as a well-behaved dataset does)."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


class Whole(IterableDataset):
    """Numbers 0..n-1 whoever reads them: every worker reads it in full."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


class Batched(torch.utils.data.Dataset):
    """A map-style dataset that fetches a batch at once (``__getitems__``), noting each batch asked."""

    def __init__(self, n: int):
        self.n, self.asked = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        raise AssertionError("a dataset with __getitems__ is fetched a batch at a time")

    def __getitems__(self, indices):
        self.asked.append(list(indices))
        return [i * i for i in indices]


def _plan(loader, kind=MAP, units=None, ranks=2, workers=2, seed=11) -> FeedPlan:
    length = len(loader) if kind == MAP else None
    return FeedPlan(0, "loader", kind, length, units if units is not None else length, ranks, workers,
                    shuffle=False, seed=seed, ahead=4)


def _pass(source: MapSource, pass_no: int) -> list[tuple[int, object, object]]:
    """(j, index, element) of this worker's share of ``pass_no``."""
    source.start_pass(pass_no)
    got = []
    while (step := source.next_index()) is not None:
        j, index = step
        got.append((j, index, source.fetch(index)))
    return got


def _stream(source: IterableSource, pass_no: int) -> list:
    source.start_pass(pass_no)
    got = []
    while True:
        try:
            got.append(source.next_element())
        except StopIteration:
            return got


def _shuffled(n=12, batch_size=2) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(n), torch.arange(n) * 10), batch_size=batch_size, shuffle=True)


def test_the_workers_of_a_map_loader_share_one_order_each_preparing_its_own_elements():
    loader = _shuffled()
    plan = _plan(loader, workers=3)
    shares = [_pass(MapSource(plan, loader, w), 0) for w in range(3)]
    for w, share in enumerate(shares):
        assert share and all(j % 3 == w for j, _, _ in share)
    by_j = {j: (index, element) for share in shares for j, index, element in share}
    assert sorted(by_j) == list(range(6))  # every element of the pass, once
    seen = []
    for j in range(6):
        index, element = by_j[j]
        x, y = element  # a batch exactly as the DataLoader yields it: [x, y], collated
        assert isinstance(element, list) and x.shape == (2,) and torch.equal(y, x * 10)
        assert x.tolist() == list(index)  # the sampler's batch of indices, fetched
        seen += x.tolist()
    assert sorted(seen) == list(range(12)) and seen != list(range(12))  # all of it, shuffled


def test_each_pass_is_reseeded_from_the_runs_seed_and_the_same_seed_gives_the_same_order():
    loader = _shuffled(n=40)
    plan = _plan(loader, workers=1)

    def order(source, pass_no):
        return [tuple(index) for _, index, _ in _pass(source, pass_no)]

    source = MapSource(plan, loader, 0)
    first, second = order(source, 0), order(source, 1)
    assert first != second  # a new order for each pass
    assert order(MapSource(plan, loader, 0), 0) == first and order(source, 1) == second  # reproducible
    other = FeedPlan(**{**plan.__dict__, "seed": plan.seed + 100})
    assert order(MapSource(other, loader, 0), 0) != first


def test_drawing_a_pass_leaves_the_processs_random_numbers_as_they_were():
    loader = _shuffled(n=40)
    source = MapSource(_plan(loader, workers=1), loader, 0)
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    _pass(source, 0)
    assert torch.equal(torch.rand(4), expected)


def test_a_pass_stops_at_its_delivered_length_cut_at_the_units():
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2)  # L = 4
    plan = _plan(loader, units=7, ranks=2, workers=2)  # passes of 4 and 3 extracted: 4 and 2 delivered
    worker0, worker1 = MapSource(plan, loader, 0), MapSource(plan, loader, 1)
    assert [j for j, _, _ in _pass(worker0, 0)] == [0, 2] and [j for j, _, _ in _pass(worker1, 0)] == [1, 3]
    assert [(j, e[0].tolist()) for j, _, e in _pass(worker0, 1)] == [(0, [0, 1])]
    assert [(j, e[0].tolist()) for j, _, e in _pass(worker1, 1)] == [(1, [2, 3])]


def test_a_plain_sequence_is_read_by_position_in_order():
    data = ["a", "b", "c", "d", "e"]
    plan = _plan(data, ranks=1, workers=2)
    assert _pass(MapSource(plan, data, 1), 0) == [(1, 1, "b"), (3, 3, "d")]
    assert _pass(make_source(plan, data, 0), 0) == [(0, 0, "a"), (2, 2, "c"), (4, 4, "e")]


def test_an_unbatched_loader_yields_single_items_and_a_batched_one_uses_getitems_and_its_collate_fn():
    single = DataLoader(TensorDataset(torch.arange(4) * 3), batch_size=None)
    got = _pass(MapSource(_plan(single, ranks=1, workers=1), single, 0), 0)
    assert [index for _, index, _ in got] == [0, 1, 2, 3]
    assert [element[0].item() for _, _, element in got] == [0, 3, 6, 9] and got[0][2][0].shape == ()
    dataset = Batched(6)
    summed = DataLoader(dataset, batch_size=3, collate_fn=lambda items: ("sum", sum(items)))
    got = _pass(MapSource(_plan(summed, ranks=1, workers=1), summed, 0), 0)
    assert [element for _, _, element in got] == [("sum", 0 + 1 + 4), ("sum", 9 + 16 + 25)]
    assert dataset.asked == [[0, 1, 2], [3, 4, 5]]


def test_an_iterable_loader_shards_by_the_worker_info_set_as_under_dataloader_workers():
    calls = []

    def init(worker_id):
        info = get_worker_info()
        calls.append((worker_id, info.id, info.num_workers))

    loader = DataLoader(Sharded(9), batch_size=2, worker_init_fn=init)
    plan = _plan(loader, kind=ITERABLE, units=8, workers=2, seed=40)
    streams = []
    for w in range(2):
        set_worker_info(loader, w, 2, plan.seed)
        info = get_worker_info()
        assert (info.id, info.num_workers, info.seed) == (w, 2, 40 + w) and info.dataset is loader.dataset
        streams.append([batch.tolist() for batch in _stream(make_source(plan, loader, w), 0)])
    assert streams == [[[0, 2], [4, 6], [8]], [[1, 3], [5, 7]]]
    assert calls == [(0, 0, 2), (1, 1, 2)]


def test_an_iterable_dataset_that_ignores_the_worker_info_is_read_in_full_by_every_worker():
    loader = DataLoader(Whole(5), batch_size=2, drop_last=True)
    plan = _plan(loader, kind=ITERABLE, units=4)
    for w in range(2):
        set_worker_info(loader, w, 2, plan.seed)
        source = IterableSource(plan, loader, w)
        assert [batch.tolist() for batch in _stream(source, 0)] == [[0, 1], [2, 3]]  # drop_last: [4] dropped
        assert [batch.tolist() for batch in _stream(source, 1)] == [[0, 1], [2, 3]]  # a new pass starts over


def test_a_plain_reiterable_is_its_own_dataset_and_starts_over_each_pass():
    class Numbers:
        def __iter__(self):
            info = get_worker_info()
            return iter([info.id * 100 + k for k in range(3)])

    numbers = Numbers()
    plan = _plan(numbers, kind=ITERABLE, units=3)
    set_worker_info(numbers, 1, 2, 0)
    assert get_worker_info().dataset is numbers
    source = make_source(plan, numbers, 1)
    assert isinstance(source, IterableSource)
    assert _stream(source, 0) == [100, 101, 102] and _stream(source, 1) == [100, 101, 102]


def test_each_worker_seeds_random_torch_and_numpy_with_the_seed_plus_its_number():
    seed_worker(20, 3)
    drawn = (random.random(), torch.rand(2), np.random.rand(2))
    random.seed(23)
    torch.manual_seed(23)
    np.random.seed(23)
    assert drawn[0] == random.random() and torch.equal(drawn[1], torch.rand(2))
    assert np.array_equal(drawn[2], np.random.rand(2))
    seed_worker(20, 4)
    assert random.random() != random.Random(23).random()
