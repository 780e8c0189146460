"""One object owns a run (kernel/runs/run.py): every part it takes is released on leaving it, whatever
happened (a rank set of one cell with it: kernel/runs/rankset.py), and the ranks receive run data in the
spec, not in their environment."""

import os
from contextlib import ExitStack

import pytest

from taas_magic.autopsy import stacks
from taas_magic.autopsy.dump import stack_file
from taas_magic.cell.closure import serialise_closure
from taas_magic.cell.pragma import PragmaOptions, settle
from taas_magic.kernel.runs.rankset import ONE_CELL, RankSet, Shape
from taas_magic.kernel.runs.run import Held, Run
from taas_magic.kernel.runs.summary import LastRun
from taas_magic.launch.local.backend import LocalBackend
from taas_magic.runspec import RunSpec
from taas_magic.writes.rule import choose_rule

SESSION = {"cache_ram": "", "ahead": 16, "timeout": None, "hang": 30.0, "restarts": 2, "place_timeout": 60.0, "output": "rank0", "keep": False}
RUN_DATA = ("TAAS_STACKS_FILE", "TAAS_CHECKPOINTS", "TAAS_KEEP_CHECKPOINTS", "TAAS_SEED")


def _held(ranks: int) -> tuple[Held, ExitStack, LocalBackend, RankSet]:
    """What the plan step holds before the run is made: the run's rank set of one cell (its backend entered) on its
    release stack."""
    settings = settle(PragmaOptions(gpus=ranks, device="cpu"), SESSION, ranks=ranks)
    releases = ExitStack()
    backend = LocalBackend(ranks, None, None, device="cpu")
    rank_set = RankSet(Shape(ranks, "cpu", ""), ONE_CELL, "testrun00001")
    rank_set.lend(releases, lambda: backend, workers=0)  # held now, released with the run
    return Held(settings, serialise_closure({"x": 1}), [], None, backend), releases, backend, rank_set


def _spec(tmp_path) -> RunSpec:
    return RunSpec(run_id="testrun00001", sys_path=(), source="x", display_source="x", filename="<taas In[1]>",
                   device="cpu", output="rank0", suppress_final=False, kernel_pid=os.getpid(), result_file_bytes=1 << 20,
                   checkpoints=str(tmp_path / "checkpoints" / "testrun00001"), keep_checkpoints=3, seed=7)


def _open_run(tmp_path) -> tuple[Run, LocalBackend]:
    held, releases, backend, rank_set = _held(2)
    spec = _spec(tmp_path)
    record = LastRun(held.settings, backend.devices, spec.run_id, ("x",))
    return Run(held, releases, spec, choose_rule(str(tmp_path), "python"), record, rank_set), backend


def test_leaving_a_failed_run_releases_every_part_and_records_how_it_ended(tmp_path):
    run, backend = _open_run(tmp_path)
    stacks_dir, layers_root = run.spec.stacks_dir, run.layers.root
    assert os.path.isdir(stacks_dir) and os.path.isdir(layers_root)
    with pytest.raises(RuntimeError, match="the ranks failed"):
        with run:
            raise RuntimeError("the ranks failed\nsecond line")
    assert not os.path.exists(stacks_dir) and not os.path.exists(layers_root)
    assert run.server.listener.fileno() == -1  # the rank server is closed
    assert backend._port.closed  # the backend is released: its reserved port given back
    assert run.record is not None and run.record.outcome == "RuntimeError: the ranks failed"


def test_a_run_that_cannot_take_a_part_releases_what_it_and_the_plan_took_and_raises_that_error(tmp_path, monkeypatch):
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("no room for the closure")

    monkeypatch.setattr("taas_magic.kernel.runs.run.ClosureHandoff", refuse)
    held, releases, backend, rank_set = _held(1)
    spec = _spec(tmp_path)
    with pytest.raises(OSError, match="no room for the closure"):
        Run(held, releases, spec, choose_rule(str(tmp_path), "python"), LastRun(held.settings, backend.devices, spec.run_id, ()),
            rank_set)
    assert backend._port.closed  # the plan's rank set, released: its backend's port given back
    assert not os.path.exists(rank_set.stacks_dir) and not os.path.exists(rank_set.layers.root)
    assert rank_set.server.listener.fileno() == -1


def test_a_rank_set_that_cannot_take_a_part_releases_what_it_took_and_raises_that_error(monkeypatch):
    made: list[str] = []
    real_make_dir = stacks.make_dir

    def make_dir(name: str) -> str:
        made.append(real_make_dir(name))
        return made[-1]

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError("no port for the rank server")

    monkeypatch.setattr(stacks, "make_dir", make_dir)
    monkeypatch.setattr("taas_magic.kernel.runs.rankset.PeerServer", refuse)
    backend = LocalBackend(1, None, None, device="cpu")
    with pytest.raises(OSError, match="no port for the rank server"):
        RankSet(Shape(1, "cpu", ""), ONE_CELL, "testrun00002").hold(backend)
    assert backend._port.closed  # entered, then released
    assert made == [made[0]] and not os.path.exists(made[0])  # the stacks folder made before the server, removed


def test_the_ranks_get_run_data_in_the_spec_and_only_torchruns_variables_and_the_owner_in_the_environment(tmp_path):
    run, _ = _open_run(tmp_path)
    with run:
        plan = run.launch_plan("HOST PORT KEY", attempt=1)
        assert plan.world_size == 2 and plan.handshake == "HOST PORT KEY"
        assert list(plan.stack_files) == [stack_file(run.spec.stacks_dir, rank) for rank in range(2)]
        for rank, env in enumerate(plan.envs):
            assert not set(RUN_DATA) & set(env), env
            assert (env["RANK"], env["WORLD_SIZE"], env["TORCHELASTIC_RESTART_COUNT"]) == (str(rank), "2", "1")
            assert env["TORCHELASTIC_MAX_RESTARTS"] == "2" and env["TAAS_OWNER"] == run.ranks.owner
            assert not {key for key in env if key.startswith("TAAS_")} - {"TAAS_OWNER"} - set(os.environ), env
        assert [(place.peer_id, place.who) for place in plan.places] == [(0, "rank 0"), (1, "rank 1")]
        assert plan.places[0].layer is None  # rank 0 writes to the repository
        assert plan.places[1].layer == run.layers.dirs[1] and plan.places[1].repository == run.rule.repository
        assert (run.spec.checkpoints, run.spec.keep_checkpoints, run.spec.seed) == (
            str(tmp_path / "checkpoints" / "testrun00001"), 3, 7)


