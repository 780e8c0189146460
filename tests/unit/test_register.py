"""taas.register / unregister / registered: what may be registered, failing at once otherwise."""

import threading

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import taas


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


class Reiterable:
    def __iter__(self):
        return iter([1, 2])


def _unregister_all():
    for loader in taas.registered():
        taas.unregister(loader)


@pytest.fixture(autouse=True)
def empty_registry():
    _unregister_all()
    yield
    _unregister_all()


@pytest.mark.parametrize("loader", [
    DataLoader(TensorDataset(torch.arange(4)), batch_size=2),  # map-style
    DataLoader(Stream(), batch_size=2),  # iterable, no len
    [torch.zeros(1), torch.ones(1)],  # any sequence
    Reiterable(),  # any re-iterable without len
], ids=["map", "iterable", "list", "reiterable"])
def test_accepts_loaders_and_reiterables_and_returns_them(loader):
    assert taas.register(loader) is loader
    assert taas.register(loader) is loader  # twice is once
    assert taas.registered() == [loader]
    taas.unregister(loader)
    assert taas.registered() == []


def test_rejects_what_cannot_be_iterated():
    with pytest.raises(TypeError, match="int object is not iterable"):
        taas.register(3)


def test_rejects_an_iterator_which_is_consumed_once():
    with pytest.raises(TypeError, match="is an iterator"):
        taas.register(iter(DataLoader(TensorDataset(torch.arange(4)))))
    with pytest.raises(TypeError, match="is an iterator"):
        taas.register(x for x in range(3))


def test_rejects_what_cannot_be_pickled_naming_why():
    class Holder:
        def __init__(self):
            self.lock = threading.Lock()

        def __iter__(self):
            return iter([])

    with pytest.raises(TypeError, match=r"Holder cannot be pickled \(TypeError: cannot pickle '_thread.lock'"):
        taas.register(Holder())
    assert taas.registered() == []


def test_unregister_of_an_unknown_loader_is_harmless():
    taas.unregister([1, 2])
    assert taas.registered() == []
