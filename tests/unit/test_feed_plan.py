"""What a registered loader is and the arithmetic of its passes (feed/plan.py), on real torch DataLoaders
over synthetic TensorDatasets and IterableDatasets, plain sequences and re-iterables: the kind, length and
shuffling read off each, the plan made on a run's terms, the run refused before launch with a line that names
the loader, and the passes' arithmetic the workers and ranks read (K cut at the last pass, remainders dropped).
That the kind is read without importing torch is checked in a fresh interpreter."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SubsetRandomSampler, TensorDataset

from taas_magic.errors import DataPlanError
from taas_magic.feed.plan import FeedTerms, loader_kind, plan_feed
from taas_magic.runspec import ITERABLE, MAP

ROOT = Path(__file__).resolve().parents[2]


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(5))


class SizedStream(IterableDataset):
    def __iter__(self):
        return iter(range(5))

    def __len__(self):
        return 5


class Reiterable:
    def __iter__(self):
        return iter([1, 2, 3])


def _terms(units=None, ranks=2, workers=3, seed=7, ahead=16) -> FeedTerms:
    return FeedTerms(units=units, ranks=ranks, workers=workers, seed=seed, ahead=ahead)


def _dataset(n: int = 10) -> TensorDataset:
    return TensorDataset(torch.arange(n), torch.arange(n) * 10)


@pytest.mark.parametrize("loader, expected", [
    (DataLoader(_dataset(10), batch_size=3), (MAP, 4, False)),  # 4 batches, the last one short
    (DataLoader(_dataset(10), batch_size=3, drop_last=True), (MAP, 3, False)),
    (DataLoader(_dataset(10), batch_size=3, shuffle=True), (MAP, 4, True)),
    (DataLoader(_dataset(10), batch_size=None), (MAP, 10, False)),  # no batching: one element per index
    (DataLoader(_dataset(10), batch_size=None, sampler=RandomSampler(range(10))), (MAP, 10, True)),
    (DataLoader(_dataset(10), batch_size=2, sampler=SubsetRandomSampler([0, 1, 2, 3])), (MAP, 2, True)),
    (DataLoader(Stream(), batch_size=2), (ITERABLE, None, False)),  # no len: unknown
    (DataLoader(SizedStream(), batch_size=2), (ITERABLE, 3, False)),  # an IterableDataset stays iterable with a len
    ([10, 20, 30], (MAP, 3, False)),  # any sequence is map-style, never shuffled
    (torch.arange(6).view(3, 2), (MAP, 3, False)),
    (Reiterable(), (ITERABLE, None, False)),
    (range(4), (MAP, 4, False)),
], ids=["batched", "drop-last", "shuffled", "unbatched", "random-sampler", "subset-sampler", "stream",
        "sized-stream", "list", "tensor", "reiterable", "range"])
def test_the_kind_length_and_shuffling_are_read_off_each_loader(loader, expected):
    assert loader_kind(loader) == expected


def test_the_kind_of_a_plain_object_is_read_without_importing_torch():
    script = ("import sys\nfrom taas_magic.feed.plan import loader_kind\n"
              "assert loader_kind([1, 2]) == ('map', 2, False)\n"
              "class R:\n    def __iter__(self): return iter(())\n"
              "assert loader_kind(R()) == ('iterable', None, False)\n"
              "print('torch' in sys.modules)")
    ran = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "False\n"


def test_one_pass_is_the_plan_when_no_units_are_given():
    loader = DataLoader(_dataset(10), batch_size=3, shuffle=True)
    plan = plan_feed(4, "train_loader", loader, _terms(ranks=2, workers=3, seed=7, ahead=16))
    assert (plan.feed, plan.name, plan.kind, plan.pass_length, plan.units) == (4, "train_loader", MAP, 4, 4)
    assert (plan.ranks, plan.workers, plan.shuffle, plan.seed, plan.ahead) == (2, 3, True, 7, 16)
    assert plan.fresh_passes == 1 and plan.total_delivered() == 4
    assert plan.describe() == "train_loader (map, 4 per pass, shuffled, --units 4 = 1 pass)"


def test_units_run_whole_passes_then_cut_the_last_one_short_and_every_pass_drops_its_remainder():
    # L = 7 elements a pass, K = 17, N = 2 ranks: passes of 7, 7 and 3 extracted; 6, 6 and 2 delivered.
    plan = plan_feed(0, "data", list(range(7)), _terms(units=17, ranks=2))
    assert plan.fresh_passes == 3
    assert [plan.fresh_length(p) for p in range(3)] == [6, 6, 2]
    assert [plan.stream_offset(p) for p in range(3)] == [0, 6, 12]
    assert plan.total_delivered() == 14
    assert plan.describe() == "data (map, 7 per pass, --units 17 = 2.42857 passes)"


def test_each_rank_gets_an_equal_share_of_a_pass():
    plan = plan_feed(0, "data", list(range(10)), _terms(units=10, ranks=4))
    assert plan.fresh_length(0) == 8  # 10 elements, 4 ranks: 2 each, 2 dropped
    assert plan.fresh_length(0) % plan.ranks == 0


def test_an_iterable_loader_without_len_is_planned_on_its_units():
    plan = plan_feed(1, "stream", DataLoader(Stream(), batch_size=2), _terms(units=6, ranks=2))
    assert (plan.kind, plan.pass_length, plan.units, plan.shuffle) == (ITERABLE, None, 6, False)
    assert plan.describe() == "stream (iterable, no len, --units 6)"


def test_a_loader_without_len_and_without_units_is_refused_naming_it_and_the_option():
    with pytest.raises(DataPlanError) as refused:
        plan_feed(0, "stream_loader", DataLoader(Stream(), batch_size=2), _terms(units=None))
    assert str(refused.value) == ("taas: stream_loader (DataLoader) has no len(), so one pass has no known size: "
                                  "give --units K, the number of elements the data workers extract")
    with pytest.raises(DataPlanError, match=r"taas: gen \(Reiterable\) has no len\(\)"):
        plan_feed(0, "gen", Reiterable(), _terms(units=None))


def test_a_map_loader_with_fewer_elements_a_pass_than_ranks_is_refused_whatever_the_units():
    loader = DataLoader(_dataset(3), batch_size=2)  # 2 elements a pass
    with pytest.raises(DataPlanError) as refused:
        plan_feed(0, "small", loader, _terms(units=100, ranks=4))
    assert str(refused.value) == "taas: small yields 2 element(s) per pass, fewer than the 4 ranks"
    assert plan_feed(0, "small", loader, _terms(units=100, ranks=2)).fresh_passes == 50  # 2 ranks: enough


def test_fewer_units_than_ranks_is_refused_for_every_kind():
    with pytest.raises(DataPlanError) as refused:
        plan_feed(0, "data", list(range(100)), _terms(units=3, ranks=4))
    assert str(refused.value) == "taas: --units 3 is fewer than the 4 ranks: every rank needs an element"
    with pytest.raises(DataPlanError, match="--units 1 is fewer than the 2 ranks"):
        plan_feed(0, "stream", DataLoader(Stream()), _terms(units=1, ranks=2))
    # an iterable loader's len is not a pass's size (a worker may shard it): only its units are checked
    assert plan_feed(0, "sized", DataLoader(SizedStream(), batch_size=4), _terms(units=4, ranks=4)).units == 4


def test_a_plan_refused_is_a_data_plan_error_that_survives_pickling():


    with pytest.raises(DataPlanError) as refused:
        plan_feed(0, "data", [1], _terms(ranks=2))
    again = pickle.loads(pickle.dumps(refused.value))  # noqa: S301 - our own pickle: the error as it crosses processes
    assert type(again) is DataPlanError and str(again) == str(refused.value)


def test_the_terms_are_frozen():
    terms = _terms()
    with pytest.raises(AttributeError):
        terms.units = 3  # type: ignore[misc]
