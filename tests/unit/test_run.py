"""One object owns a run (kernel/runs/run.py): every part it takes is released on leaving it, whatever
happened, and the ranks receive run data in the spec, not in their environment."""

import os

import pytest

from taas_magic.autopsy.dump import stack_file
from taas_magic.cell.closure import serialise_closure
from taas_magic.cell.pragma import PragmaOptions, settle
from taas_magic.kernel.runs.run import Run
from taas_magic.kernel.runs.summary import LastRun
from taas_magic.launch.backend import LocalBackend
from taas_magic.runspec import RunSpec
from taas_magic.writes.rule import choose_rule

SESSION = {"cache_ram": "", "ahead": 16, "timeout": None, "restarts": 2, "place_timeout": 60.0, "output": "rank0"}
RUN_DATA = ("TAAS_STACKS_FILE", "TAAS_CHECKPOINTS", "TAAS_KEEP_CHECKPOINTS", "TAAS_SEED")


def _open_run(tmp_path) -> tuple[Run, LocalBackend]:
    settings = settle(PragmaOptions(gpus=2, device="cpu"), SESSION, ranks=2)
    run = Run(settings, serialise_closure({"x": 1}), [])
    run.hold_data(None)
    backend = run.hold_backend(LocalBackend(2, None, None, device="cpu"))
    spec = RunSpec(run_id="testrun00001", sys_path=(), source="x", display_source="x", filename="<taas In[1]>",
                   device="cpu", output="rank0", suppress_final=False, kernel_pid=os.getpid(), result_file_bytes=1 << 20,
                   checkpoints=str(tmp_path / "checkpoints" / "testrun00001"), keep_checkpoints=3, seed=7)
    record = LastRun(settings, backend.devices, spec.run_id, ("x",))
    run.open(spec, choose_rule(str(tmp_path), "python"), record)
    return run, backend


def test_leaving_a_failed_run_releases_every_part_and_records_how_it_ended(tmp_path):
    run, backend = _open_run(tmp_path)
    stacks_dir, layers_root = run.spec.stacks_dir, run.layers.root
    assert os.path.isdir(stacks_dir) and os.path.isdir(layers_root)
    with pytest.raises(RuntimeError, match="the ranks failed"):
        with run:
            raise RuntimeError("the ranks failed\nsecond line")
    assert not os.path.exists(stacks_dir) and not os.path.exists(layers_root)
    assert run.server.listener.fileno() == -1  # the rank server is closed
    assert backend._port.fileno() == -1  # the backend is released: its reserved port given back
    assert run.record is not None and run.record.outcome == "RuntimeError: the ranks failed"


def test_a_plan_that_fails_half_way_releases_what_it_took(tmp_path):
    settings = settle(PragmaOptions(gpus=1, device="cpu"), SESSION, ranks=1)
    run = Run(settings, serialise_closure({}), [])
    backend = run.hold_backend(LocalBackend(1, None, None, device="cpu"))
    run.close()
    assert backend._port.fileno() == -1


def test_the_ranks_get_run_data_in_the_spec_and_only_torchruns_variables_and_the_owner_in_the_environment(tmp_path):
    run, _ = _open_run(tmp_path)
    with run:
        plan = run.launch_plan("HOST PORT KEY", attempt=1)
        assert plan.world_size == 2 and plan.handshake == "HOST PORT KEY"
        assert list(plan.stack_files) == [stack_file(run.spec.stacks_dir, rank) for rank in range(2)]
        for rank, env in enumerate(plan.envs):
            assert not set(RUN_DATA) & set(env), env
            assert (env["RANK"], env["WORLD_SIZE"], env["TORCHELASTIC_RESTART_COUNT"]) == (str(rank), "2", "1")
            assert env["TORCHELASTIC_MAX_RESTARTS"] == "2" and env["TAAS_OWNER"] == run.owner
            assert not {key for key in env if key.startswith("TAAS_")} - {"TAAS_OWNER"} - set(os.environ), env
        assert [(place.peer_id, place.who) for place in plan.places] == [(0, "rank 0"), (1, "rank 1")]
        assert plan.places[0].layer is None  # rank 0 writes to the repository
        assert plan.places[1].layer == run.layers.dirs[1] and plan.places[1].repository == run.rule.repository
        assert (run.spec.checkpoints, run.spec.keep_checkpoints, run.spec.seed) == (
            str(tmp_path / "checkpoints" / "testrun00001"), 3, 7)


def test_a_plan_that_fails_before_the_header_leaves_the_error_as_it_was(tmp_path):
    """The plan step pushes the run on its undo stack: leaving with an error before ``open`` releases, records nothing."""
    settings = settle(PragmaOptions(gpus=1, device="cpu"), SESSION, ranks=1)
    run = Run(settings, serialise_closure({}), [])
    backend = run.hold_backend(LocalBackend(1, None, None, device="cpu"))
    with pytest.raises(ValueError, match="no data plan"):
        with run:
            raise ValueError("no data plan")
    assert backend._port.fileno() == -1 and run.record is None
