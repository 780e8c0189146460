"""Warm spares: later cells start from processes that already imported torch, yet every
cell still gets fresh processes with the launch's environment, cwd and write rule."""

import os
import signal
import time

from tests.kernel_client import wait_for_spares, wait_until_gone

PIDS = "#pragma taas --device cpu --gpus 2 --output all\nimport os, sys\nprint('pid', os.getpid(), 'torch' in sys.modules, flush=True)"


def _pids(ran) -> dict[int, bool]:
    found = {}
    for line in ran.stream("stdout").splitlines():
        if " pid " in line:
            *_, pid, preloaded = line.split()
            found[int(pid)] = preloaded == "True"
    return found


def test_later_cells_start_from_spares_and_never_reuse_a_process(kernel):
    kernel.execute("%taas warm auto")
    kernel.execute(PIDS)  # leaves two spares behind
    assert wait_for_spares(kernel, 2)
    spares = {p.pid for p in kernel.spares()}
    ran = kernel.execute(PIDS)
    first = _pids(ran)
    assert set(first) == spares  # the cell took the waiting spares...
    assert all(first.values())  # ...which had torch imported before the cell began
    second = _pids(kernel.execute(PIDS))
    assert not set(second) & set(first)  # fresh processes for every cell


def test_no_state_passes_from_one_cell_to_the_next(kernel):
    kernel.execute("%taas warm auto")
    kernel.execute("#pragma taas --device cpu --gpus 2\nimport json\njson.left_behind = 1")
    assert wait_for_spares(kernel, 2)
    spares = {p.pid for p in kernel.spares()}
    ran = kernel.execute("#pragma taas --device cpu --gpus 2 --output all\nimport json, os\nprint('leak', hasattr(json, 'left_behind'), os.getpid())")
    assert ran.stream().count("leak False") == 2, ran.stream()
    assert {int(line.split()[-1]) for line in ran.stream().splitlines() if "leak" in line} == spares  # ran on spares


def test_spares_take_the_environment_and_cwd_of_the_launch_not_their_own(kernel, tmp_path):
    kernel.execute("%taas warm auto")
    kernel.execute(PIDS)
    assert wait_for_spares(kernel, 2)
    spares = {p.pid for p in kernel.spares()}
    kernel.execute(f"import os\nos.environ['TAAS_TEST_LATE'] = 'late'\n_old = os.getcwd()\nos.chdir({str(tmp_path)!r})")
    try:
        ran = kernel.execute(
            "#pragma taas --device cpu --gpus 2 --output all\nimport os, torch\n"
            "print('env', os.environ.get('TAAS_TEST_LATE'), os.getcwd(), os.environ['RANK'], torch.get_num_threads())\n"
            "print('pid', os.getpid(), flush=True)"
        )
    finally:
        kernel.execute("os.chdir(_old)\ndel os.environ['TAAS_TEST_LATE']")
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // 2))
    for rank in (0, 1):
        assert f"[rank {rank}] env late {tmp_path} {rank} {threads}" in ran.stream(), ran.stream()
    assert {int(line.split()[-1]) for line in ran.stream().splitlines() if " pid " in line} == spares  # they were spares


def test_a_cell_that_comes_while_the_spares_warm_takes_them_instead_of_fresh_processes(kernel):
    """Warm means warm: a spare still importing torch is further on than any fresh process. (Off and on
    again: the spare factory is retired, so the spares after the next cell start as fresh processes
    while a new factory imports, instead of forks that are warm within milliseconds.)"""
    kernel.execute("%taas warm off")
    kernel.execute("%taas warm auto")
    kernel.execute(PIDS)  # its spares start warming as the cell ends
    warming = kernel.spares()
    assert len(warming) == 2 and any(p.name() != "taas-spare" for p in warming), "the spares were already warm"
    ran = kernel.execute(PIDS)  # at once: the spares are still importing
    assert ran.reply["status"] == "ok", ran.error_text()
    assert set(_pids(ran)) == {p.pid for p in warming}  # the cell took them and waited, instead of starting two more
    assert all(_pids(ran).values())


def test_warm_off_and_n_control_the_spares_and_status_reports_their_memory(kernel):
    kernel.execute("%taas warm 3")
    assert wait_for_spares(kernel, 3)
    status = kernel.execute("%taas status").stream()
    assert "warm spares: 3, 3 waiting" in status and "MB resident" in status
    kernel.execute("%taas warm off")
    assert kernel.spares() == []
    kernel.execute(PIDS)
    assert kernel.spares() == []  # off stays off after a cell
    kernel.execute("%taas warm auto")


def test_spares_and_their_factory_die_with_the_kernel(new_kernel):
    lone = new_kernel()
    lone.execute("%taas warm 2")
    assert wait_for_spares(lone, 2)
    for _ in range(20):  # once the factory has imported, the spares after a cell are forks of it
        lone.execute(PIDS)
        assert wait_for_spares(lone, 2)
        factories, spares = lone.factories(), lone.spares()
        if len(factories) == 1 and all(spare.ppid() == factories[0].pid for spare in spares):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the spares never came from the factory: {factories}, {[s.ppid() for s in spares]}")
    os.kill(lone.pid, signal.SIGKILL)
    assert not wait_until_gone(spares + factories, timeout=30)
