"""The warm-spare pool's rules: which spare serves which rank, and that a warming one is taken, not thrown away."""

import subprocess

import pytest

from taas_magic.launch.spares import Spare, SparePool, bindings


@pytest.fixture
def sleepers():
    """Stand-ins for spares that are still warming: live processes not (yet) named taas-spare."""
    made: list[subprocess.Popen] = []

    def make() -> subprocess.Popen:
        made.append(subprocess.Popen(["sleep", "60"], stdin=subprocess.PIPE, start_new_session=True))
        return made[-1]

    yield make
    for process in made:
        process.kill()
        process.wait()
        process.stdin.close()


def test_rank_k_is_bound_to_gpu_k_while_the_host_has_one():
    assert bindings(3, gpus=2) == [0, 1, None]
    assert bindings(2, gpus=0) == [None, None]


def test_a_gpu_spare_serves_only_its_gpu_under_the_same_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    spare = Spare(process=None, gpu=1, visible="2,3")  # type: ignore[arg-type]
    assert spare.serves(1) and not spare.serves(0) and not spare.serves(None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the person changed what the kernel sees
    assert not spare.serves(1)
    assert Spare(process=None, gpu=None, visible="2,3").serves(None)  # type: ignore[arg-type]


def test_warming_spares_are_taken_by_binding_and_the_rest_start_fresh(sleepers, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pool = SparePool()
    on_gpu0, on_gpu1, on_cpu = sleepers(), sleepers(), sleepers()
    pool.spares = [Spare(on_gpu1, 1, None), Spare(on_cpu, None, None), Spare(on_gpu0, 0, None)]
    assert not any(spare.ready for spare in pool.spares)  # still warming: taken all the same
    assert pool.take([0, 1, 2]) == [on_gpu0, on_gpu1, None]  # GPU 2 has no spare: that rank starts fresh
    assert [spare.process for spare in pool.spares] == [on_cpu]  # the CPU spare waits for a CPU cell
    assert pool.take([None, None]) == [on_cpu, None]
    assert pool.spares == []


def test_fill_stops_the_spares_no_rank_would_take(sleepers):
    pool = SparePool()
    stale = sleepers()
    pool.spares = [Spare(stale, 0, "7")]  # bound under another CUDA_VISIBLE_DEVICES
    pool.fill(0)
    assert pool.spares == [] and stale.poll() is not None


def test_dead_spares_are_dropped_before_taking(sleepers):
    pool = SparePool()
    dead, alive = sleepers(), sleepers()
    dead.kill()
    dead.wait()
    pool.spares = [Spare(dead, None, None), Spare(alive, None, None)]
    assert pool.take([None]) == [alive]
