"""launch/local/standby.py: spares warmed on a thread of their own while a run runs, settled by the run.

Real threads and real fills (functions that record which thread ran them, or raise); the delays are
either zero or far longer than the test, so nothing depends on the machine's speed.
"""

from __future__ import annotations

import threading
import time

import pytest

from taas_magic.launch.local.standby import Standby

pytestmark = pytest.mark.unpinned  # pure Python threads: nothing of the minimums' pins (.ci/run)


def test_a_fill_runs_on_the_standby_thread_and_settle_waits_for_it():
    standby = Standby()
    release, ran = threading.Event(), []

    def fill():
        release.wait(10)
        ran.append(threading.current_thread().name)

    assert not standby.busy
    standby.start(fill, 0)
    assert standby.busy
    threading.Timer(0.2, release.set).start()
    standby.settle()  # waits for the fill under way
    assert ran == ["taas-standby"] and not standby.busy


def test_a_fill_still_waiting_for_its_delay_is_cancelled_by_settle():
    standby = Standby()
    ran = []
    standby.start(lambda: ran.append("filled"), delay=60)
    started = time.monotonic()
    standby.settle()
    assert time.monotonic() - started < 30  # not the delay: cancelled
    assert ran == [] and not standby.busy


def test_a_fill_after_its_delay_runs_when_no_one_settled_first():
    standby = Standby()
    done = threading.Event()
    standby.start(done.set, delay=0.05)
    assert done.wait(10)
    standby.settle()


def test_what_the_fill_raised_is_raised_by_settle_on_the_runs_thread_once():
    standby = Standby()

    def fill():
        raise OSError(24, "Too many open files")

    standby.start(fill, 0)
    with pytest.raises(OSError, match="Too many open files"):
        standby.settle()
    standby.settle()  # raised once: the next settle has nothing to say


def test_settle_without_a_fill_does_nothing_and_a_standby_serves_again_after_a_cancel():
    standby = Standby()
    standby.settle()
    standby.start(lambda: None, delay=60)
    standby.settle()  # cancelled
    done = threading.Event()
    standby.start(done.set, delay=0.01)  # the cancel of the last one does not cancel this one
    assert done.wait(10)
    standby.settle()

