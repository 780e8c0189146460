"""The warm-spare pool's rules: which spare serves which rank, and that a warming one is taken, not thrown away."""

import subprocess

import pytest

from taas_magic.launch.spares import Spare, SparePool, _start, bindings, frozen_settings


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


def test_a_spare_serves_only_its_binding_under_the_settings_it_started_with(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    spare = Spare(process=None, gpu=1, settings=frozen_settings())  # type: ignore[arg-type]
    assert spare.serves(1) and not spare.serves(0) and not spare.serves(None)
    cpu = Spare(process=None, gpu=None, settings=frozen_settings())  # type: ignore[arg-type]
    assert cpu.serves(None) and not cpu.serves(0)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # read once, when CUDA starts
    assert not spare.serves(1) and not cpu.serves(None)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the person changed what the kernel sees
    assert not spare.serves(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("TAAS_TEST_OTHER", "x")  # what is read after the spare is taken does not count
    assert spare.serves(1)


def test_a_cpu_spare_on_a_gpu_host_sees_no_gpu_and_a_gpu_spare_does(monkeypatch):
    monkeypatch.setattr("taas_magic.launch.spares.SPARE_COMMAND", ("sh", "-c", 'echo "[$CUDA_VISIBLE_DEVICES]"; exec sleep 60'))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    seen = {}
    for name, gpu, hide in (("cpu on a gpu host", None, True), ("cpu on a cpu host", None, False), ("gpu", 0, True)):
        spare = _start(gpu, hide_gpus=hide)
        try:
            seen[name] = spare.process.stdout.readline().decode().strip()
        finally:
            pool = SparePool()
            pool.spares = [spare]
            pool.close()
            spare.process.stdout.close()
            spare.process.stderr.close()
            spare.process.stdin.close()
    assert seen == {"cpu on a gpu host": "[]", "cpu on a cpu host": "[0]", "gpu": "[0]"}


def test_warming_spares_are_taken_by_binding_and_the_rest_start_fresh(sleepers, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pool = SparePool()
    on_gpu0, on_gpu1, on_cpu = sleepers(), sleepers(), sleepers()
    settings = frozen_settings()
    pool.spares = [Spare(on_gpu1, 1, settings), Spare(on_cpu, None, settings), Spare(on_gpu0, 0, settings)]
    assert not any(spare.ready for spare in pool.spares)  # still warming: taken all the same
    assert pool.take([0, 1, 2]) == [on_gpu0, on_gpu1, None]  # GPU 2 has no spare: that rank starts fresh
    assert [spare.process for spare in pool.spares] == [on_cpu]  # the CPU spare waits for a CPU cell
    assert pool.take([None, None]) == [on_cpu, None]
    assert pool.spares == []


def test_fill_stops_the_spares_no_rank_would_take(sleepers):
    pool = SparePool()
    stale = sleepers()
    pool.spares = [Spare(stale, 0, {"CUDA_VISIBLE_DEVICES": "7"})]  # bound under another CUDA_VISIBLE_DEVICES
    pool.fill(0)
    assert pool.spares == [] and stale.poll() is not None


def test_dead_spares_are_dropped_before_taking(sleepers):
    pool = SparePool()
    dead, alive = sleepers(), sleepers()
    dead.kill()
    dead.wait()
    pool.spares = [Spare(dead, None, frozen_settings()), Spare(alive, None, frozen_settings())]
    assert pool.take([None]) == [alive]
