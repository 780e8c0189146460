"""The session's compile cache (compilecache/): each rank's environment points torch's compile caches into
one owner-only folder of the session, a person's own variables win, and the folder goes with the session."""

import os
import stat
import subprocess
import sys
from contextlib import ExitStack

import pytest

from taas_magic.cell.closure import serialise_closure
from taas_magic.cell.pragma import PragmaOptions, settle
from taas_magic.compilecache import artifacts
from taas_magic.compilecache.folder import PREFIX, CompileCache, rank_variables, torch_default_folder
from taas_magic.kernel.runs.rankset import ONE_CELL, RankSet, Shape
from taas_magic.kernel.runs.run import Held, Run
from taas_magic.kernel.runs.summary import LastRun
from taas_magic.launch.local.backend import LocalBackend
from taas_magic.runspec import RunSpec
from taas_magic.writes.rule import choose_rule

SESSION = {"cache_ram": "", "ahead": 16, "timeout": None, "hang": 30.0, "restarts": 0, "place_timeout": 60.0, "output": "rank0", "keep": False}
VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")


@pytest.fixture(autouse=True)
def no_variables_of_our_own(monkeypatch):
    for name in VARIABLES:  # the test process's own environment must not decide what a rank gets
        monkeypatch.delenv(name, raising=False)


def _rank_envs(tmp_path, compile_cache: str) -> list[dict[str, str]]:
    """The environments a 2-rank run's ranks are started with, the run's spec naming ``compile_cache``."""
    settings = settle(PragmaOptions(gpus=2, device="cpu"), SESSION, ranks=2)
    releases = ExitStack()
    backend = LocalBackend(2, None, None, device="cpu")
    rank_set = RankSet(Shape(2, "cpu", ""), ONE_CELL, "compile00001")
    rank_set.lend(releases, lambda: backend, workers=0)
    held = Held(settings, serialise_closure({}), [], None, backend)
    spec = RunSpec(run_id="compile00001", sys_path=(), source="x", display_source="x", filename="<taas In[1]>",
                   device="cpu", output="rank0", suppress_final=False, kernel_pid=os.getpid(), result_file_bytes=1 << 20,
                   compile_cache=compile_cache)
    record = LastRun(settings, backend.devices, spec.run_id, ())
    with Run(held, releases, spec, choose_rule(str(tmp_path), "python"), record, rank_set) as run:
        return run.launch_plan("HOST PORT KEY", attempt=0).envs


def test_every_rank_points_torchs_compile_caches_into_the_sessions_owner_only_folder(tmp_path):
    cache = CompileCache(str(tmp_path))
    folder = cache.folder()
    assert cache.folder() == folder  # one folder for the session
    assert os.path.basename(folder).startswith(f"{PREFIX}{os.getpid()}-")  # its kernel named, for the orphan sweep
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    for env in _rank_envs(tmp_path, folder):
        assert env["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(folder, "inductor")
        assert env["TRITON_CACHE_DIR"] == os.path.join(folder, "triton")
        assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
    cache.close()
    assert not os.path.exists(folder)
    assert cache.folder() != folder and os.path.isdir(cache.path)  # a later cell gets a new one
    cache.close()


def test_a_persons_own_variables_win(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    folder = str(tmp_path / "session")
    for env in _rank_envs(tmp_path, folder):
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
        assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "0"
        assert env["TRITON_CACHE_DIR"] == os.path.join(folder, "triton")  # what they did not set is still ours
        assert env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"


def test_turned_off_the_ranks_get_none_of_the_variables(tmp_path):
    for env in _rank_envs(tmp_path, ""):
        assert not set(VARIABLES) & set(env), env


def test_a_folder_a_killed_kernel_left_is_swept_when_a_session_makes_its_own(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f"{PREFIX}{int(dead.stdout)}-abcd"
    (left / "inductor").mkdir(parents=True)
    alive = tmp_path / f"{PREFIX}{os.getpid()}-efgh"  # another session of this process: not an orphan
    alive.mkdir()
    cache = CompileCache(str(tmp_path))
    cache.folder()
    assert not left.exists() and alive.exists()
    cache.close()


def test_rank_variables_are_the_four_torch_reads():
    assert set(rank_variables("/f")) == set(VARIABLES)


def test_artifacts_that_cannot_be_read_warn_once_and_never_fail_the_rank(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(artifacts, "_warned", False)
    assert artifacts.load(str(tmp_path), 0) is False  # nothing saved yet: nothing to load, nothing said
    assert capsys.readouterr().err == ""
    path = artifacts.artifact_file(str(tmp_path), 0)
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as damaged:
        damaged.write(b"not torch's artifacts")
    assert artifacts.load(str(tmp_path), 0) is False
    assert artifacts.load(str(tmp_path), 0) is False
    err = capsys.readouterr().err
    assert err.count("taas: the session's compile cache could not be loaded") == 1, err


def test_artifacts_are_written_whole_or_not_at_all(tmp_path, monkeypatch):
    path = artifacts.artifact_file(str(tmp_path), 1)
    artifacts._write_whole(path, b"first")

    def refuse(source: str, target: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError):
        artifacts._write_whole(path, b"second")
    with open(path, "rb") as kept:
        assert kept.read() == b"first"
    assert os.listdir(os.path.dirname(path)) == ["rank-1.bin"]  # no partial file left
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_torchs_own_default_in_the_kernels_environment_is_not_a_persons_choice(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert torch_default_folder() == os.path.abspath(default_cache_dir())  # the folder torch writes there, as torch names it
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", torch_default_folder())  # what importing Dynamo in the kernel leaves
    folder = str(tmp_path / "session")
    for env in _rank_envs(tmp_path, folder):
        assert env["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(folder, "inductor")
