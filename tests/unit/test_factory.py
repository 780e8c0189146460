"""The spare factory: a real factory process imports torch once and forks real spares.

What the pool and the launcher rely on: a forked spare is warm at once, leads its own
session on its own pipes, and its exit code reaches the kernel through the factory (its
parent); while the factory imports the pool starts spares the slow way, but a cell's rank with
no spare waits for it and is a fork; a retired factory
leaves once its last spare has ended, and one whose kernel side closes leaves at once.
"""

import os
import select
import subprocess
import sys
import threading
import time

import psutil
import pytest

from taas_magic.launch.local.sparefactory import ForkedSpare, SpareFactory
from taas_magic.launch.local.spares import SINGLE_THREADED, SparePool, frozen_settings
from taas_magic.launch.rankenv import CPU, Binding
from taas_magic.procs import reap
from taas_magic.rank.factory import _fresh_randomness

pytestmark = pytest.mark.unpinned  # the spare factory: nothing of the minimums' pins but torch (.ci/run)


def _ready_factory(step: bool = True, timeout: float = 60) -> SpareFactory:
    factory = SpareFactory({**os.environ, **SINGLE_THREADED}, frozen_settings(), step)
    deadline = time.monotonic() + timeout
    while not factory.ready:
        assert factory.alive() and time.monotonic() < deadline, "the factory never finished importing"
        factory.collect()
        time.sleep(0.05)
    return factory


def _until(condition, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def factory():
    made = _ready_factory()
    yield made
    made.close()


def test_a_forked_spare_is_warm_at_once_in_its_own_session_and_its_exit_code_comes_back(factory):
    spare = factory.spawn(CPU)
    assert isinstance(spare, ForkedSpare)
    process = psutil.Process(spare.pid)
    assert _until(lambda: process.name() == "taas-spare"), process.name()  # imported and stepped: waiting
    used = process.cpu_times()
    # warm at once: it imported nothing and took no step of its own (a fresh interpreter's import of torch alone
    # is about 1.5 s of CPU here, the step 0.7 s). CPU time, which a busy machine does not stretch as it does
    # the wall time a fork takes to be scheduled
    assert used.user + used.system < 0.4, used
    assert process.ppid() == factory.process.pid and os.getsid(spare.pid) == spare.pid
    assert spare.poll() is None
    spare.stdin.close()  # the kernel's lifeline ends before any handshake: the spare leaves (its watchdog may be first)
    assert spare.wait(timeout=60) in (1, -9)
    reap(spare)


def test_a_killed_spare_reports_its_signal_and_leaves_no_zombie(factory):
    spare = factory.spawn(Binding(None, ""))
    assert spare is not None
    os.killpg(spare.pid, 9)
    assert spare.wait(timeout=60) == -9
    reap(spare)
    assert not psutil.pid_exists(spare.pid) or psutil.Process(spare.pid).status() != psutil.STATUS_ZOMBIE


def test_while_the_factory_imports_the_pool_starts_fresh_spares_then_forks_them(monkeypatch):
    pool = SparePool()
    try:
        pool.fill([CPU])
        assert isinstance(pool.spares[0].process, subprocess.Popen)  # the factory is still importing
        assert not pool.forks_ready()
        assert _until(pool.forks_ready, timeout=60)  # it hears the factory say "ready" by itself
        pool.close(wait=30)  # every factory reaped: none is left to the garbage collector's warnings
        pool.factory = _ready_factory()
        pool.fill([CPU, CPU])
        assert [type(spare.process) for spare in pool.spares] == [ForkedSpare, ForkedSpare]
    finally:
        pool.close(wait=30)  # every factory reaped: none is left to the garbage collector's warnings


def _cpu(process: psutil.Process) -> float:
    used = process.cpu_times()
    return used.user + used.system


def _end(spare) -> None:
    os.killpg(spare.pid, 9)
    spare.wait(timeout=60)
    reap(spare)


def test_a_cells_ranks_with_no_spare_wait_for_the_importing_factory_and_are_its_forks():
    """The extension starts the factory as it loads (``prepare``); a cell sent before its imports are
    done takes forks of it, not fresh interpreters (which would each import torch again, side by
    side), and those forks take no warm-up step: the cell is waiting for them."""
    pool = SparePool()
    taken = []
    try:
        pool.prepare()
        assert pool.factory is not None and not pool.forks_ready()  # still importing
        taken = pool.take([CPU, CPU])
        assert [type(process) for process in taken] == [ForkedSpare, ForkedSpare]
        for process in taken:
            child = psutil.Process(process.pid)
            assert child.ppid() == pool.factory.process.pid
            assert _until(lambda: child.name() == "taas-spare"), child.name()
            used = child.cpu_times()
            assert used.user + used.system < 0.4, used  # no first training step (about 0.7 s of CPU here)
    finally:
        for process in taken:
            if process is not None:
                _end(process)
        pool.close(wait=30)  # every factory reaped: none is left to the garbage collector's warnings


def test_after_a_cells_waiting_forks_the_factory_takes_the_first_step_for_the_spares_after_them():
    """The forks a cell waited for skip the warm-up step; the factory then takes it itself, once they
    have ended and no request waits, so the spares forked after it are warm at once rather than each
    paying the step (about 0.8 s here) while the next cell waits for them (the soak test's slow runs)."""
    pool = SparePool()
    taken, later = [], None
    try:
        pool.prepare()
        assert pool.factory is not None and not pool.forks_ready()  # still importing
        taken = pool.take([CPU, CPU])
        factory = psutil.Process(pool.factory.process.pid)
        idle = _cpu(factory)  # imported, and forked the two: it waits
        for process in taken:  # the cell's ranks end
            _end(process)
        taken = []
        # no child, no request: the factory takes the step (about 0.7 s of CPU here; reaping two children costs it
        # well under 0.1 s); once it has begun, a request waits for it. Not a fixed wait: a loaded machine may
        # take seconds to schedule the factory at all
        assert _until(lambda: _cpu(factory) - idle > 0.1), "the factory never took the step"
        later = pool.factory.spawn(CPU)
        child = psutil.Process(later.pid)
        assert _until(lambda: child.name() == "taas-spare", timeout=30), child.name()
        used = child.cpu_times()
        assert used.user + used.system < 0.4, used  # it took no step of its own: the factory's serves it
    finally:
        for process in [*taken, later]:
            if process is not None:
                _end(process)
        pool.close(wait=30)


def test_a_cells_wait_for_an_importing_factory_interrupted_leaves_no_spare_behind():
    """An interrupt while a cell's rank waits for the factory's imports: the request was sent, so
    the factory forks that spare once it has imported; its stdin is already closed and it leaves."""
    import signal

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted

    factory = SpareFactory({**os.environ, **SINGLE_THREADED}, frozen_settings(), step=False)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)  # well inside its import of torch
        with pytest.raises(Interrupted):
            factory.spawn(CPU, for_cell=True)
        # it imports, forks the spare asked for, and that spare finds its stdin closed and leaves
        assert _until(lambda: factory.collect() or factory.exits, timeout=60), "no spare was forked and left"
        assert not psutil.Process(factory.process.pid).children()
        assert factory.alive() and not factory.broken
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        factory.close()


def test_a_factory_that_dies_while_importing_leaves_the_cells_ranks_to_start_fresh():
    pool = SparePool()
    try:
        pool.prepare()
        assert pool.factory is not None
        os.killpg(pool.factory.process.pid, 9)
        assert pool.take([CPU]) == [None]  # the launcher starts rank 0 as a fresh interpreter
        assert pool.factory is None or pool.factory.broken
    finally:
        pool.close(wait=30)  # every factory reaped: none is left to the garbage collector's warnings


def test_a_retired_factory_leaves_after_its_last_spare_and_a_closed_one_at_once(factory):
    spare = factory.spawn(CPU)
    assert spare is not None
    factory.retire()
    time.sleep(0.3)
    assert factory.alive()  # its spare (a rank, perhaps) still runs: it reports that exit too
    assert factory.spawn(CPU) is None  # retired: no more forks
    os.killpg(spare.pid, 9)
    assert spare.wait(timeout=60) == -9
    reap(spare)
    assert _until(lambda: not factory.alive())
    other = _ready_factory(step=False)
    other.close()
    assert other.process.returncode == 0


def test_a_fork_draws_its_own_numpy_numbers():
    numpy = pytest.importorskip("numpy")
    numpy.random.seed(1234)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        _fresh_randomness()
        os.write(write, numpy.random.bytes(16))
        os._exit(0)
    os.close(write)
    child = os.read(read, 16)
    os.close(read)
    os.waitpid(pid, 0)
    assert child != numpy.random.bytes(16)  # the parent's next numbers, which the fork would have drawn too


def test_a_spares_exit_code_is_known_as_soon_as_it_has_ended(factory):
    """A rank's end is its run's end: once the spare's pidfd says it ended, one poll has its code
    (the factory reports it the moment it reaps it, not at its next look)."""
    spare = factory.spawn(CPU)
    assert spare is not None
    watch = os.pidfd_open(spare.pid)
    try:
        os.killpg(spare.pid, 9)
        assert select.select([watch], [], [], 60)[0], "the spare never ended"
        assert spare.poll() == -9
    finally:
        os.close(watch)
        reap(spare)


def test_a_spawn_gets_its_answer_while_run_threads_poll_their_spares(factory):
    """The factory's socket is read by the pool (a spawn's answer) and by every run's supervisor
    (its ranks' exits) at once: neither may swallow what the other waits for."""
    running = factory.spawn(CPU)
    assert running is not None
    stop = threading.Event()

    def supervise() -> None:
        while not stop.is_set():
            running.poll()

    pollers = [threading.Thread(target=supervise) for _ in range(2)]
    for poller in pollers:
        poller.start()
    try:
        spawned = [factory.spawn(CPU) for _ in range(6)]
    finally:
        stop.set()
        for poller in pollers:
            poller.join()
    try:
        assert all(isinstance(spare, ForkedSpare) for spare in spawned) and not factory.broken, spawned
    finally:
        for spare in [running, *spawned]:
            if spare is not None:
                os.killpg(spare.pid, 9)
                spare.wait(timeout=60)
                reap(spare)


def test_warming_the_compiler_imports_dynamo_and_inductor_and_keeps_the_cpu_probe_in_one_thread():
    """What a compiler factory does before its forks (rank/factory.py's ``warm_compiler``), in a process of its own:
    Dynamo and Inductor imported, Inductor's CPU probe answered and kept (its fork asks no child Python), one thread."""
    code = ("import sys, os\nfrom taas_magic.rank.factory import warm_compiler\nprint(warm_compiler())\n"
            "from torch._inductor import cpu_vec_isa\n"
            "print('torch._dynamo' in sys.modules, 'torch._inductor.compile_fx' in sys.modules,\n"
            "      cpu_vec_isa.valid_vec_isa_list.cache_info().currsize, len(os.listdir('/proc/self/task')))\n")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **SINGLE_THREADED})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["True", "True", "True", "1", "1"], ran.stdout + ran.stderr


def test_once_the_session_compiles_a_factory_with_the_compiler_warmed_takes_over_and_its_forks_replace_the_spares():
    """``compiles()`` starts a compiler factory beside the serving one, which goes on forking meanwhile; once it is
    ready, the next fill (or take) makes it the serving factory, retires the old one (it leaves once its spares are
    stopped), and replaces the old one's spares by forks of the new one."""
    pool = SparePool()
    try:
        pool.factory = _ready_factory()
        pool.fill([CPU, CPU])
        old = pool.factory
        assert not old.compiler and [spare.compiler for spare in pool.spares] == [False, False]
        pool.compiles()
        pool.compiles()  # once a session
        coming = pool.factories.upcoming
        assert coming is not None and coming.compiler
        pool.fill([CPU, CPU])  # while it warms, the old one serves
        assert pool.factory is old and "warming torch's compiler" in pool.describe("auto")
        assert _until(lambda: "compiler warmed" in pool.describe("auto"), timeout=300), pool.describe("auto")
        pool.fill([CPU, CPU])
        assert pool.factory is coming and pool.factories.upcoming is None
        assert [spare.compiler for spare in pool.spares] == [True, True]
        assert all(psutil.Process(spare.process.pid).ppid() == coming.process.pid for spare in pool.spares)
        assert _until(lambda: not old.alive(), timeout=60)  # retired, its spares stopped: it left
        assert "torch's compiler warmed in it" in pool.describe("auto")
    finally:
        pool.close(wait=30)
