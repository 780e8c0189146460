"""An exported job's runtime (taas_magic/export/job.py) rank by rank: the job folder, the values loaded, rank 0's names
saved and loaded back (and refused from a folder others may write), the rank's variables taken from Slurm's
(export/launcher.py), and a rank set up as a taas rank in a real process. (The launch as ``python SCRIPT``, its
restarts and timeout: tests/unit/test_job.py; a registered loader's share: tests/unit/test_jobfeed.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from taas_magic.export import launcher
from taas_magic.export.job import Job, job_folder, load_results

RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def script(tmp_path) -> str:
    """A job's script path, its folder made as :func:`job.start` makes it."""
    path = tmp_path / "train.py"
    os.makedirs(job_folder(str(path)), mode=0o700)
    return str(path)


def test_the_job_folder_is_beside_the_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert job_folder("/work/jobs/train.py") == "/work/jobs/train.taas"
    assert job_folder("jobs/run.v2.py") == str(tmp_path / "jobs" / "run.v2.taas")


def test_values_come_in_the_order_named(script):
    torch.save({"lr": 0.1, "scale": torch.ones(2), "name": "net"}, os.path.join(job_folder(script), "values.pt"))
    rank = Job(script, 0, 1)
    name, lr = rank.values("name", "lr")
    assert (name, lr) == ("net", 0.1)
    (scale,) = rank.values("scale")
    assert torch.equal(scale, torch.ones(2))


def test_rank_0_saves_only_what_the_cell_bound_each_on_its_own(script, capsys):
    kept, rebound = [1, 2], torch.zeros(1)
    namespace = {"kept": kept, "rebound": rebound, "os": os, "_taas": object()}
    rank = Job(script, 0, 1)
    rank.begin_cell(namespace)
    namespace.update(rebound=torch.ones(1), new=3, _private=4, json=__import__("json"), lock=threading.Lock(),
                     model=torch.nn.DataParallel(torch.nn.Linear(2, 1)))  # a wrapper: its module is saved
    rank.finish(namespace)
    assert capsys.readouterr().err == "taas: not saved for the notebook: lock (TypeError)\n"
    names = load_results(script)
    assert sorted(names) == ["model", "new", "rebound"]
    assert names["new"] == 3 and torch.equal(names["rebound"], torch.ones(1))
    assert type(names["model"]) is torch.nn.Linear
    assert torch.equal(names["model"].weight, namespace["model"].module.weight)


def test_a_name_the_cell_binds_again_is_saved_though_its_new_object_could_take_the_old_ones_address(script):
    namespace = {"x": [0]}
    rank = Job(script, 0, 1)
    rank.begin_cell(namespace)
    namespace["x"] = None  # the old list freed in the cell (a loop's ``loss = ...``), then a new one bound
    namespace["x"] = [5]
    rank.finish(namespace)
    assert load_results(script) == {"x": [5]}


def test_other_ranks_save_nothing(script):
    rank = Job(script, 1, 2)
    rank.begin_cell({})
    rank.finish({"x": 1})
    assert os.listdir(job_folder(script)) == []


def test_results_are_refused_before_a_run_and_from_a_folder_others_may_write(script):
    with pytest.raises(FileNotFoundError) as missing:
        load_results(script)
    results = os.path.join(job_folder(script), "results.pt")
    assert str(missing.value) == f"taas: {script} has no results yet ({results}): run it, then load it"
    Job(script, 0, 1).finish({"x": 1})
    assert load_results(script) == {"x": 1}
    os.chmod(job_folder(script), 0o770)
    with pytest.raises(PermissionError) as refused:
        load_results(script)
    assert str(refused.value) == f"taas: {job_folder(script)} is not yours alone (its owner or mode): not unpickled"
    os.chmod(job_folder(script), 0o700)
    os.chmod(results, 0o646)
    with pytest.raises(PermissionError) as refused:
        load_results(script)
    assert str(refused.value) == f"taas: {results} is not yours alone (its owner or mode): not unpickled"


@pytest.fixture
def environ(monkeypatch):
    """os.environ without the rank's or Slurm's variables; whatever the test sets there is undone after it."""
    for name in [*RANK_VARIABLES, *(name for name in os.environ if name.startswith("SLURM_"))]:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def test_a_slurm_task_takes_its_rank_from_slurms_variables(environ):
    for name, value in {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)",
                        "SLURM_JOB_ID": "131234", "MASTER_ADDR": "node7"}.items():
        environ.setenv(name, value)
    launcher.rank_from_slurm()
    assert {name: os.environ[name] for name in RANK_VARIABLES} == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node7",
        "MASTER_PORT": "31234"}  # 20000 + 131234 % 20000


def test_a_slurm_task_without_a_local_id_or_per_node_count_or_job_id(environ):
    for name, value in {"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "MASTER_ADDR": "10.0.0.1",
                        "MASTER_PORT": "29500"}.items():
        environ.setenv(name, value)
    launcher.rank_from_slurm()
    assert {name: os.environ[name] for name in RANK_VARIABLES} == {
        "RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500"}  # a port already given is kept


RANK_SCRIPT = """from taas_magic.export import job as _taas_job
_taas = _taas_job.start(__file__, ranks=2, device="cpu", shared=("parts",))
import os
os.makedirs("parts", exist_ok=True)
open(f"parts/rank{_taas.rank}.txt", "w").write("mine")
open("stray.txt", "w").write(str(_taas.rank))
print(_taas.rank, _taas.world, os.environ["RANK"], os.environ["LOCAL_WORLD_SIZE"],
      repr(os.environ["CUDA_VISIBLE_DEVICES"]), os.path.exists("stray.txt"), flush=True)
"""


def test_a_rank_other_than_0_writes_into_a_layer_thrown_away_but_shared_folders_in_place(tmp_path):
    """As Slurm starts task 1 of 3: the job was exported for 2 ranks, which the rank says; no torch is needed."""
    (tmp_path / "job.py").write_text(RANK_SCRIPT)
    env = {name: value for name, value in os.environ.items() if name not in RANK_VARIABLES and "SLURM" not in name}
    env.update(SLURM_PROCID="1", SLURM_NTASKS="3", SLURM_LOCALID="1", MASTER_ADDR="127.0.0.1", TAAS_REPO=str(tmp_path),
               CUDA_VISIBLE_DEVICES="0")
    ran = subprocess.run([sys.executable, "job.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout == "1 3 1 3 '' True\n"  # it sees its own write; on cpu no GPU
    assert ran.stderr == "taas: this job was exported for 2 rank(s) and runs as 3\n"
    assert sorted(path.name for path in (tmp_path / "parts").iterdir()) == ["rank1.txt"]
    assert not (tmp_path / "stray.txt").exists()
    assert oct((tmp_path / "job.taas").stat().st_mode & 0o777) == "0o700"
