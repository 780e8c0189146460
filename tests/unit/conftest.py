"""Every unit test's garbage is collected as it ends: an object it leaked (a spare factory's
process, a socket) warns then, in that test, instead of in whichever later test the collector
happens to run in (pytest turns the ResourceWarning into that test's failure)."""

import gc

import pytest


@pytest.fixture(autouse=True)
def _collected_as_each_test_ends():
    yield
    gc.collect()
