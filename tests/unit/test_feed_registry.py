"""The process's list of registered loaders (feed/registry.py), called directly as the face passes calls
through: objects are kept by identity in registration order, a failed registration leaves the list as it was
and says why in one line, and importing the module (what ``import taas`` does) loads neither torch nor the
pickler until something is registered, which a fresh interpreter checks. (taas.register's accepted kinds are
tests/unit/test_register.py's.)"""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from taas_magic.feed import registry
from taas_magic.feed.registry import register, registered, unregister

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def empty_registry():
    """Each test starts from, and leaves, an empty list (it is the process's)."""
    for loader in registered():
        unregister(loader)
    yield
    for loader in registered():
        unregister(loader)


def test_loaders_are_kept_by_identity_in_registration_order():
    first, second, third = [1, 2], [1, 2], (3, 4)  # first == second, but two objects
    assert register(first) is first and register(second) is second and register(third) is third
    register(first)  # again: still once, in its first place
    kept = registered()
    assert len(kept) == 3 and all(a is b for a, b in zip(kept, [first, second, third]))
    unregister(second)  # equal to first, but not first: first stays
    assert [id(loader) for loader in registered()] == [id(first), id(third)]


def test_the_list_returned_is_a_copy():
    loader = [1]
    register(loader)
    registered().clear()
    assert registered() == [loader]
    assert registry._registered is not registered()


def test_unregistering_what_was_never_registered_changes_nothing():
    loader = [1]
    register(loader)
    unregister([1])  # equal, not the same object
    unregister("never registered")
    assert registered() == [loader] and registered()[0] is loader


@pytest.mark.parametrize("thing, message", [
    (3, "taas.register: int object is not iterable; register a DataLoader or another object that can be "
        "iterated more than once"),
    (iter([1, 2]), "taas.register: list_iterator is an iterator, which can be consumed only once; register the "
                   "re-iterable object that produces it (e.g. the DataLoader)"),
], ids=["not-iterable", "iterator"])
def test_what_cannot_be_iterated_again_is_refused_in_one_line(thing, message):
    with pytest.raises(TypeError) as refused:
        register(thing)
    assert str(refused.value) == message
    assert registered() == []


def test_an_unpicklable_loader_is_refused_naming_the_pickling_error_and_no_chained_traceback():
    class Locked:
        def __init__(self):
            self.lock = threading.Lock()

        def __iter__(self):
            return iter([])

    kept = [0]
    register(kept)
    with pytest.raises(TypeError) as refused:
        register(Locked())
    assert str(refused.value) == ("taas.register: Locked cannot be pickled (TypeError: cannot pickle "
                                  "'_thread.lock' object); data workers run in other processes and must receive "
                                  "the loader")
    assert refused.value.__suppress_context__ and refused.value.__cause__ is None  # one line, not two tracebacks
    assert registered() == [kept]


def test_importing_the_registry_loads_nothing_heavy_until_a_loader_is_registered():
    script = ("import sys\nfrom taas_magic.feed import registry\n"
              "heavy = ('torch', 'numpy', 'cloudpickle', 'taas_magic.transfer.pickler')\n"
              "print(sorted(name for name in heavy if name in sys.modules))\n"
              "registry.register([1, 2])\n"
              "print('taas_magic.transfer.pickler' in sys.modules, 'torch' in sys.modules)")
    ran = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "[]\nTrue False\n"
