"""The warm-spare pool's rules: which spare serves which rank, and that a warming one is taken, not thrown away."""

import os
import subprocess

import pytest

from taas_magic.errors import LaunchError
from taas_magic.launch.contract import GpuSlice
from taas_magic.launch.local.backend import LocalBackend
from taas_magic.launch.local.spares import Spare, SparePool, _start, bindings, frozen_settings, slice_bindings
from taas_magic.launch.rankenv import CPU, Binding, visible_gpu_ids
from taas_magic.rank.factory import see_gpus


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
    assert bindings(3, gpus=2, host_gpus=2) == [Binding(0), Binding(1), Binding(None, "")]  # a CPU rank sees no GPU
    assert bindings(2, gpus=0) == [CPU, CPU]


def test_trials_side_by_side_each_see_their_own_slice_of_what_the_kernel_sees(monkeypatch):
    assert slice_bindings(["4", "5", "6", "7"], 2, 2) == [Binding(0, "4,5"), Binding(1, "4,5"),
                                                           Binding(0, "6,7"), Binding(1, "6,7")]
    monkeypatch.setattr("taas_magic.launch.rankenv.visible_gpu_count", lambda: 3)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a1, GPU-b2,GPU-c3")
    assert visible_gpu_ids() == ["GPU-a1", "GPU-b2", "GPU-c3"]  # UUIDs stay UUIDs: a slice names the same devices
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpu_ids() == ["0", "1", "2"]


def test_a_spare_sets_its_bindings_gpus_before_cuda_starts(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    seen = []
    for visible in (None, "2,3", ""):
        see_gpus(visible)
        seen.append(os.environ["CUDA_VISIBLE_DEVICES"])
    assert seen == ["0,1,2,3", "2,3", ""]  # the factory's own; a trial's slice; none, for --device cpu


def test_a_spare_serves_only_its_binding_under_the_settings_it_started_with(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    spare = Spare(process=None, binding=Binding(1), settings=frozen_settings())  # type: ignore[arg-type]
    assert spare.serves(Binding(1)) and not spare.serves(Binding(0)) and not spare.serves(CPU)
    assert not spare.serves(Binding(1, "3"))  # GPU 1 of another slice is another device
    cpu = Spare(process=None, binding=CPU, settings=frozen_settings())  # type: ignore[arg-type]
    assert cpu.serves(CPU) and not cpu.serves(Binding(0)) and not cpu.serves(Binding(None, ""))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # read once, when CUDA starts
    assert not spare.serves(Binding(1)) and not cpu.serves(CPU)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the person changed what the kernel sees
    assert not spare.serves(Binding(1))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("TAAS_TEST_OTHER", "x")  # what is read after the spare is taken does not count
    assert spare.serves(Binding(1))


def test_a_cpu_spare_on_a_gpu_host_sees_no_gpu_and_a_gpu_spare_does(monkeypatch):
    monkeypatch.setattr("taas_magic.launch.local.spares.SPARE_COMMAND",
                        ("sh", "-c", 'echo "[$CUDA_VISIBLE_DEVICES]"; exec sleep 60'))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    seen = {}
    for name, binding in (("cpu on a gpu host", Binding(None, "")), ("cpu on a cpu host", CPU), ("gpu", Binding(0)),
                          ("gpu 1 of a slice", Binding(1, "4,5"))):
        spare = _start(binding)
        try:
            seen[name] = spare.process.stdout.readline().decode().strip()
        finally:
            pool = SparePool()
            pool.spares = [spare]
            pool.close(wait=30)  # every factory reaped: none is left to the garbage collector's warnings
            spare.process.stdout.close()
            spare.process.stderr.close()
            spare.process.stdin.close()
    assert seen == {"cpu on a gpu host": "[]", "cpu on a cpu host": "[0]", "gpu": "[0]", "gpu 1 of a slice": "[4,5]"}


def test_warming_spares_are_taken_by_binding_and_the_rest_start_fresh(sleepers, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pool = SparePool()
    on_gpu0, on_gpu1, on_cpu = sleepers(), sleepers(), sleepers()
    settings = frozen_settings()
    pool.spares = [Spare(on_gpu1, Binding(1), settings), Spare(on_cpu, CPU, settings), Spare(on_gpu0, Binding(0), settings)]
    assert not any(spare.ready for spare in pool.spares)  # still warming: taken all the same
    assert pool.take([Binding(0), Binding(1), Binding(2)]) == [on_gpu0, on_gpu1, None]  # no spare on GPU 2: fresh
    assert [spare.process for spare in pool.spares] == [on_cpu]  # the CPU spare waits for a CPU cell
    assert pool.take([CPU, CPU]) == [on_cpu, None]
    assert pool.spares == []


def test_fill_stops_the_spares_no_rank_would_take(sleepers):
    pool = SparePool()
    stale = sleepers()
    pool.spares = [Spare(stale, Binding(0), {"CUDA_VISIBLE_DEVICES": "7"})]  # bound under another CUDA_VISIBLE_DEVICES
    pool.fill([])
    assert pool.spares == [] and stale.poll() is not None


def test_dead_spares_are_dropped_before_taking(sleepers):
    pool = SparePool()
    dead, alive = sleepers(), sleepers()
    dead.kill()
    dead.wait()
    pool.spares = [Spare(dead, CPU, frozen_settings()), Spare(alive, CPU, frozen_settings())]
    assert pool.take([CPU]) == [alive]


def test_a_trial_on_its_slice_keeps_every_slices_spares_warm(sleepers, monkeypatch):
    """Four GPUs (as the kernel sees them: 4,5,6,7), two trials of two side by side: the second
    trial's ranks see its slice, and what its backend keeps warm (for its restart, and after it)
    is both slices' spares: keeping its own must not stop the other trial's."""
    monkeypatch.setenv("TAAS_VISIBLE_GPUS", "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    pool = SparePool()
    waiting = {binding: sleepers() for binding in slice_bindings(["4", "5", "6", "7"], 2, 2)}
    pool.spares = [Spare(process, binding, frozen_settings()) for binding, process in waiting.items()]
    second = LocalBackend(2, pool, lambda: 4, "auto", GpuSlice(1, 2))
    try:
        assert [second.rank_extra_env(rank) for rank in (0, 1)] == [{"CUDA_VISIBLE_DEVICES": "6,7"}] * 2
        second.standby(may_restart=True)
        second.release()
        assert [spare.process for spare in pool.spares] == list(waiting.values())  # none stopped, none started
        assert pool.take([Binding(0, "6,7"), Binding(1, "6,7")]) == [waiting[Binding(0, "6,7")], waiting[Binding(1, "6,7")]]
    finally:
        second.release()
        pool.close(wait=30)  # every factory reaped: none is left to the garbage collector's warnings
    with pytest.raises(LaunchError, match="need 6 GPUs; this host shows the kernel 4"):
        LocalBackend(2, None, None, "auto", GpuSlice(0, 3))
