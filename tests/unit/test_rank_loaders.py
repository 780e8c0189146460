"""A registered loader as the cell sees it in a rank (taas_magic/rank/loaders.py): each ``for`` is the next pass,
begun at its first element (an iterator only made, as Lightning's probe, takes nothing), asking the kernel for
``CREDIT`` elements ahead and more as it consumes them, each element read from the record the kernel names; a loop
left early abandons its pass and what the kernel still sends for it; two loaders share the rank's one inbox;
``len`` is this rank's share of its next pass (a map-style feed only), other attributes the original loader's,
unpickled only when first read; and the loader never leaves its rank.

Over a real authenticated channel: the rank's end (its inbox, rank/inbox.py) in this process, the kernel's end a
real PeerServer (tests/unit/rankside.py) answering ``Want`` frames with ``Elements`` and ``End``; the elements are
real records written to a segment file as a data worker writes them (transfer/records.py)."""

from __future__ import annotations

import os
import pickle
import types

import cloudpickle
import pytest
import torch

from taas_magic.protocol import Elements, End, Want
from taas_magic.rank.inbox import Inbox
from taas_magic.rank.loaders import CREDIT, PreparedLoader, prepared_loaders
from taas_magic.runspec import ITERABLE, MAP, FeedPlan, RankFeed
from taas_magic.transfer import records
from tests.unit.rankside import KernelEnd, connect_here


def plan(feed: int = 0, kind: str = MAP, pass_length: int | None = 10, units: int = 10, ranks: int = 1,
         name: str = "train") -> FeedPlan:
    return FeedPlan(feed=feed, name=name, kind=kind, pass_length=pass_length, units=units, ranks=ranks, workers=1,
                    shuffle=False, seed=0, ahead=4)


ORIGINAL = cloudpickle.dumps(types.SimpleNamespace(batch_size=8, dataset=[1, 2, 3]))


@pytest.fixture
def wired():
    """(the rank's inbox, the kernel's end of its channel); both closed after the test."""
    kernel = KernelEnd()
    channel, rank = connect_here(kernel)
    inbox = Inbox(channel)
    yield inbox, rank
    rank.close()
    channel.close()
    kernel.close()


@pytest.fixture
def segment(tmp_path):
    """``segment(elements)``: the elements written as records to one segment file; their places, in order."""

    def write(elements: list) -> list[tuple[str, int]]:
        path = str(tmp_path / f"segment-{len(os.listdir(tmp_path))}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        places, at = [], 0
        try:
            for element in elements:
                head, buffers, length = records.encode(element)
                os.ftruncate(fd, records.aligned(at + length))  # pre-sized, as a worker's segment is
                records.write(fd, at, head, buffers)
                places.append((path, at))
                at = records.aligned(at + length)
        finally:
            os.close(fd)
        return places

    return write


def elements(n: int, start: int = 0) -> list[dict]:
    return [{"x": torch.full((3,), float(i)), "y": i} for i in range(start, start + n)]


def values(taken: list) -> list[int]:
    assert all(torch.equal(element["x"], torch.full((3,), float(element["y"]))) for element in taken)
    return [element["y"] for element in taken]


def test_a_pass_reads_the_named_records_in_order_asking_for_credit_ahead_and_as_it_consumes(wired, segment):
    inbox, rank = wired
    loader = PreparedLoader(plan(), ORIGINAL, prepared_client(inbox))
    places = segment(elements(5))
    probe = iter(loader)  # made and never advanced, as Lightning does: takes nothing
    del probe
    rank.send(Elements(0, 0, places[:3]), Elements(0, 0, places[3:]), End(0, 0))
    assert values(list(loader)) == [0, 1, 2, 3, 4]
    assert [rank.receive() for _ in range(3)] == [Want(0, 0, CREDIT), Want(0, 0, CREDIT // 2), Want(0, 0, CREDIT // 2)]


def test_each_for_is_the_next_pass_and_a_cell_changing_an_element_changes_only_its_own_copy(wired, segment):
    inbox, rank = wired
    loader = PreparedLoader(plan(), ORIGINAL, prepared_client(inbox))
    places = segment(elements(1))
    rank.send(Elements(0, 0, places), End(0, 0))
    (first,) = list(loader)
    first["x"].add_(100)  # in place, in the rank
    rank.send(Elements(0, 1, places), End(0, 1))  # the next pass replays the same record
    (again,) = list(loader)
    assert values([again]) == [0]
    assert [rank.receive() for _ in range(2)] == [Want(0, 0, CREDIT), Want(0, 1, CREDIT)]


def test_leaving_a_loop_early_abandons_its_pass_and_what_the_kernel_still_sends_for_it(wired, segment):
    inbox, rank = wired
    loader = PreparedLoader(plan(), ORIGINAL, prepared_client(inbox))
    first, second = segment(elements(3)), segment(elements(2, start=10))
    rank.send(Elements(0, 0, first[:2]))
    for element in loader:
        assert element["y"] == 0
        break
    rank.send(Elements(0, 0, first[2:]), End(0, 0), Elements(0, 1, second), End(0, 1))  # pass 0's rest comes late
    assert values(list(loader)) == [10, 11]
    assert [rank.receive() for _ in range(2)] == [Want(0, 0, CREDIT), Want(0, 1, CREDIT)]


def test_a_pass_begun_while_an_older_one_is_read_ends_the_older_one(wired, segment):
    inbox, rank = wired
    loader = PreparedLoader(plan(), ORIGINAL, prepared_client(inbox))
    places = segment(elements(4))
    rank.send(Elements(0, 0, places[:2]), Elements(0, 1, places[2:]))
    older = iter(loader)
    assert next(older)["y"] == 0
    newer = iter(loader)
    assert next(newer)["y"] == 2
    assert list(older) == []  # abandoned: its second element, though here, is not given
    assert next(newer)["y"] == 3


def test_two_loaders_share_the_ranks_inbox_each_reading_only_its_own_feed(wired, segment):
    inbox, rank = wired
    loaders = prepared_loaders((RankFeed(plan(feed=3, name="train"), ORIGINAL), RankFeed(plan(feed=5, name="val"), ORIGINAL)),
                               inbox)
    assert sorted(loaders) == [3, 5] and loaders[3]._client is loaders[5]._client  # one client, one inbox
    train, val = segment(elements(2)), segment(elements(2, start=50))
    rank.send(Elements(5, 0, val), End(5, 0), Elements(3, 0, train), End(3, 0))  # the other feed's frames come first
    assert values(list(loaders[3])) == [0, 1]
    assert values(list(loaders[5])) == [50, 51]


def test_no_registered_loader_no_client():
    assert prepared_loaders((), inbox=None) == {}  # type: ignore[arg-type]  # nothing is read from it


def test_len_is_this_ranks_share_of_its_next_pass_fresh_then_replayed(wired):
    inbox, rank = wired
    loader = PreparedLoader(plan(pass_length=10, units=25, ranks=2), ORIGINAL, prepared_client(inbox))  # 3 fresh passes
    lengths = []
    for pass_no in range(6):
        lengths.append(len(loader))
        rank.send(End(0, pass_no))
        assert list(loader) == []
    assert lengths == [5, 5, 2, 5, 5, 2]  # the third fresh pass has 5 elements: 4 delivered over 2 ranks


def test_an_iterable_loader_has_no_length_and_says_why(wired):
    inbox, _ = wired
    loader = PreparedLoader(plan(kind=ITERABLE, pass_length=None, name="stream"), ORIGINAL, prepared_client(inbox))
    with pytest.raises(TypeError) as no_length:
        len(loader)
    assert str(no_length.value) == "stream is an iterable loader: its passes have no length known in advance"


def test_other_attributes_are_the_original_loaders_unpickled_only_when_first_read(wired, segment):
    inbox, rank = wired
    loader = PreparedLoader(plan(), b"not a pickle", prepared_client(inbox))
    rank.send(Elements(0, 0, segment(elements(1))), End(0, 0))
    assert values(list(loader)) == [0] and len(loader) == 10  # iterating and len never read the original
    assert not hasattr(loader, "__array__")  # a probe for a protocol reads nothing either
    with pytest.raises(pickle.UnpicklingError):
        _ = loader.batch_size
    good = PreparedLoader(plan(), ORIGINAL, prepared_client(inbox))
    assert good.batch_size == 8 and good.dataset == [1, 2, 3]
    with pytest.raises(AttributeError):
        _ = good.no_such_attribute


def test_a_prepared_loader_never_leaves_its_rank(wired):
    inbox, _ = wired
    loader = PreparedLoader(plan(name="train_loader"), ORIGINAL, prepared_client(inbox))
    for dumps in (pickle.dumps, cloudpickle.dumps):
        with pytest.raises(TypeError) as refused:
            dumps(loader)
        assert str(refused.value) == "train_loader is a taas prepared loader: it lives in its rank and cannot be pickled"


def test_its_repr_describes_the_feed():
    loader = PreparedLoader(plan(name="train", pass_length=10, units=25), ORIGINAL, client=None)  # type: ignore[arg-type]
    assert repr(loader) == "<taas prepared loader train (map, 10 per pass, --units 25 = 2.5 passes)>"


def prepared_client(inbox: Inbox):
    """The client :func:`prepared_loaders` makes for the rank's inbox."""
    (loader,) = prepared_loaders((RankFeed(plan(), ORIGINAL),), inbox).values()
    return loader._client
