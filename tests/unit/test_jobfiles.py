"""The files of an exported job (taas_magic/export/files.py): the script's text, its sbatch and Ray entry
points, written all or none, with the notebook's values beside them; the written script run as ``python SCRIPT`` and
the sbatch file's restart loop run by bash. (The whole of ``%taas export`` in a kernel: tests/kernel/test_export.py.)"""

from __future__ import annotations

import ast
import os
import re
import shlex
import subprocess
import sys
import threading

import pytest
import torch

from taas_magic.export.carry import Carried, Definition, ExportError
from taas_magic.export.files import Launch, check_plain_python, ray_text, sbatch_text, script_text, write_job
from taas_magic.export.job import load_results

CPU = Launch(ranks=2, device="cpu", restarts=0, timeout=None, shared=())
CARRIED = Carried(
    imports={"json": "import json", "F": "import torch.nn.functional as F", "js": "import json"},
    definitions={"train": Definition("train", 3, 4, "def train(steps):\n    return helper(steps)\n"),
                 "helper": Definition("helper", 2, 1, "@staticmethod\ndef helper(v):\n    return v * scale\n")},
    values={"scale": 0.5, "lr": 0.05, "loader": [1, 2, 3]},
    loaders=["loader"],
)


def job_env() -> dict[str, str]:
    """This environment with no rank's variables (so the script starts its ranks itself) and no GPU."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT")
    env = {name: value for name, value in os.environ.items() if name not in drop and not name.startswith("SLURM_")}
    return {**env, "CUDA_VISIBLE_DEVICES": ""}


def test_a_cell_that_uses_ipython_is_refused_with_its_line():
    check_plain_python("x = 1\nprint(get_ipython)\n", 4)  # plain Python: nothing said
    for translated in ("get_ipython().run_line_magic('time', 'x = 1')", "get_ipython().system('ls')"):
        with pytest.raises(ExportError) as refused:
            check_plain_python(f"import os\n{translated}\n", 4)
        assert str(refused.value) == ("taas: In[4] line 2 uses IPython (a %magic or !command), and the job runs "
                                      "without it: write that line in Python")


def test_the_script_starts_the_job_then_defines_loads_feeds_and_runs_the_cell():
    launch = Launch(ranks=2, device="cpu", restarts=1, timeout=30.0, shared=("parts",), cpus=4, units=64, seed=7)
    text = script_text("/work/jobs/train.py", 7, "total = train(3)\nprint(total)\n\n", CARRIED, launch)
    head, _, rest = text.partition("\n\n")
    assert re.fullmatch(r'#!/usr/bin/env python3\n"""In\[7\] of a notebook, exported by taas on '
                        r'\d{4}-\d\d-\d\d \d\d:\d\d: 2 rank\(s\) on cpu\.', head), head
    assert rest == "\n".join([
        "Run it: `python train.py` (it starts its 2 ranks itself), `torchrun --nproc-per-node 2 --max-restarts 1 "
        "train.py`,",
        "`sbatch train.sbatch` or `python train_ray.py`. It needs torch and taas_magic, not Jupyter. The notebook",
        "values the cell reads are in train.taas/values.pt; rank 0's names land in train.taas/, and",
        '`taas.load_job("train.py")` binds them in a notebook.',
        '"""',
        "from taas_magic.export import job as _taas_job",
        "",
        "_taas = _taas_job.start(__file__, ranks=2, device='cpu', restarts=1, timeout=30.0, shared=('parts',))",
        "",
        "# -- what the cell reads of the notebook " + "-" * 70,
        "import json",  # once, though two names carry it
        "import torch.nn.functional as F",
        "",
        "# In[2]",
        "@staticmethod",
        "def helper(v):",
        "    return v * scale",
        "",
        "# In[3]",
        "def train(steps):",
        "    return helper(steps)",
        "",
        "loader, lr, scale = _taas.values('loader', 'lr', 'scale')",
        "loader = _taas.feed(loader, cpus=4, units=64, seed=7, name='loader')",
        "",
        "# -- the cell: In[7] " + "-" * 80,
        "_taas.begin_cell(globals())",
        "total = train(3)",
        "print(total)",
        "",
        "_taas.finish(globals())",
        "",
    ])
    ast.parse(text)


def test_one_value_is_unpacked_from_a_tuple_and_no_values_load_nothing():
    one = script_text("/j/t.py", 2, "y = x", Carried(values={"x": 1}), CPU)
    assert "\nx, = _taas.values('x')\n" in one
    none = script_text("/j/t.py", 2, "y = 1", Carried(), CPU)
    assert "_taas.values(" not in none and "_taas.feed(" not in none
    assert "`torchrun --nproc-per-node 2 t.py`," in none  # no --max-restarts without restarts
    assert "_taas = _taas_job.start(__file__, ranks=2, device='cpu', restarts=0, timeout=None, shared=())" in none


def test_the_sbatch_file_runs_one_task_per_rank_with_the_notebooks_interpreter():
    python = shlex.quote(sys.executable)
    assert sbatch_text("/work/jobs/train.py", CPU) == "\n".join([
        "#!/bin/bash",
        "# train.py as a Slurm job: one task per rank, started by srun (the ranks read Slurm's variables).",
        f"# Submit it from the folder the notebook ran in; the interpreter is the notebook's ({sys.executable}).",
        "#SBATCH --job-name=train",
        "#SBATCH --ntasks=2",
        "#SBATCH --output=/work/jobs/train.taas/slurm-%j.out",
        f'srun {python} /work/jobs/train.py "$@"',
        "",
    ])


def test_the_sbatch_file_of_a_gpu_cell_with_a_timeout_and_restarts():
    launch = Launch(ranks=4, device="cuda", restarts=2, timeout=150.0, shared=())
    assert sbatch_text("/work/my jobs/train.py", launch).split("\n")[3:] == [
        "#SBATCH --job-name=train",
        "#SBATCH --ntasks=4",
        "#SBATCH --gpus-per-task=1",
        "#SBATCH --output=/work/my jobs/train.taas/slurm-%j.out",
        "#SBATCH --time=3",  # minutes: 150 s is 2.5, and a minute more
        "for attempt in $(seq 0 2); do",
        "    export TORCHELASTIC_RESTART_COUNT=$attempt",
        f"    srun {shlex.quote(sys.executable)} '/work/my jobs/train.py' \"$@\" && exit 0",
        '    echo "taas: the job failed (attempt $attempt of 3)" >&2',
        "done",
        "exit 1",
        "",
    ]


@pytest.mark.parametrize("timeout, minutes", [(1.0, "1"), (59.0, "1"), (60.0, "2"), (3600.0, "61")])
def test_the_sbatch_time_limit_is_the_timeout_in_whole_minutes_and_one_more(timeout, minutes):
    text = sbatch_text("/j/t.py", Launch(ranks=1, device="cpu", restarts=0, timeout=timeout, shared=()))
    assert [line for line in text.split("\n") if line.startswith("#SBATCH --time=")] == [f"#SBATCH --time={minutes}"]


def test_the_ray_entry_point_runs_the_script_beside_it():
    text = ray_text("/work/jobs/train.py", Launch(ranks=3, device="cuda", restarts=0, timeout=None, shared=()))
    assert text == "\n".join([
        "#!/usr/bin/env python3",
        '"""train.py on a Ray cluster: one task per rank (`python train_ray.py`, or',
        "`ray job submit -- python ...`); rank 0's output shows here, and its names land beside train.py.\"\"\"",
        "import os",
        "",
        "from taas_magic.export import launcher",
        "",
        "launcher.run_on_ray(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train.py'), ranks=3, gpus=True)",
        "",
    ])
    assert "ranks=2, gpus=False)" in ray_text("/j/t.py", CPU)
    ast.parse(text)


def test_write_job_writes_every_file_and_the_values_beside_them(tmp_path):
    script = tmp_path / "jobs" / "train.py"
    script.parent.mkdir()
    written = write_job(str(script), 5, "y = x + 1\n", Carried(values={"x": torch.arange(3)}), CPU)
    assert written == [str(script), str(tmp_path / "jobs" / "train.sbatch"), str(tmp_path / "jobs" / "train_ray.py"),
                       str(tmp_path / "jobs" / "train.taas" / "values.pt")]
    assert sorted(os.listdir(tmp_path / "jobs")) == ["train.py", "train.sbatch", "train.taas", "train_ray.py"]
    assert os.listdir(tmp_path / "jobs" / "train.taas") == ["values.pt"]
    assert script.read_text().endswith("_taas.begin_cell(globals())\ny = x + 1\n\n_taas.finish(globals())\n")
    assert (tmp_path / "jobs" / "train.sbatch").read_text() == sbatch_text(str(script), CPU)
    assert (tmp_path / "jobs" / "train_ray.py").read_text() == ray_text(str(script), CPU)
    modes = {name: oct(os.stat(tmp_path / "jobs" / name).st_mode & 0o777)
             for name in ("train.py", "train.sbatch", "train_ray.py", "train.taas", "train.taas/values.pt")}
    assert modes == {"train.py": "0o755", "train.sbatch": "0o755", "train_ray.py": "0o755", "train.taas": "0o700",
                     "train.taas/values.pt": "0o600"}
    values = torch.load(tmp_path / "jobs" / "train.taas" / "values.pt", weights_only=False)
    assert list(values) == ["x"] and torch.equal(values["x"], torch.arange(3))


def test_a_failed_write_leaves_the_earlier_export_as_it_was_and_nothing_half_written(tmp_path):
    script = tmp_path / "train.py"
    write_job(str(script), 5, "y = x\n", Carried(values={"x": 1}), CPU)
    before = {path: path.read_bytes() for path in sorted(tmp_path.rglob("*")) if path.is_file()}
    with pytest.raises(TypeError, match="cannot pickle '_thread.lock' object"):
        write_job(str(script), 6, "y = lock\n", Carried(values={"lock": threading.Lock()}),
                  Launch(ranks=3, device="cuda", restarts=1, timeout=9.0, shared=()))
    assert {path: path.read_bytes() for path in sorted(tmp_path.rglob("*")) if path.is_file()} == before
    assert torch.load(tmp_path / "train.taas" / "values.pt", weights_only=False) == {"x": 1}


def test_the_written_script_runs_as_python_script_and_leaves_rank_0s_names(tmp_path):
    """A 1-rank CPU job: the definitions, the values and a registered loader fed as the data workers would."""
    carried = Carried(
        imports={"json": "import json"},
        definitions={"helper": Definition("helper", 2, 1, "def helper(v):\n    return json.dumps(v * scale)\n")},
        values={"scale": 3, "loader": torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(6)),
                                                                   batch_size=2)},
        loaders=["loader"],
    )
    cell = ("import os\nseen = [int(x) for (batch,) in loader for x in batch]\nsaid = helper(2)\n"
            "print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'gpus', repr(os.environ['CUDA_VISIBLE_"
            "DEVICES']), 'seen', seen, 'said', said, flush=True)\n")
    script = tmp_path / "train.py"
    write_job(str(script), 9, cell, carried, Launch(ranks=1, device="cpu", restarts=0, timeout=60.0, shared=()))
    ran = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=job_env(), capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout == "rank 0 of 1 gpus '' seen [0, 1, 2, 3, 4, 5] said 6\n"
    assert load_results(str(script)) == {"seen": [0, 1, 2, 3, 4, 5], "said": "6"}


def test_the_sbatch_files_steps_run_again_after_a_failure_with_the_attempt_set(tmp_path):
    """The sbatch file run by bash, ``srun`` standing for Slurm's (no controller here): it starts task 1 of 2 with the
    variables srun gives a task; the script takes its rank from them, and the loop starts it again once."""
    cell = ("import os\nattempt = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
            "print('attempt', attempt, 'rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], 'local', "
            "os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'], 'at', os.environ['MASTER_ADDR'], "
            "os.environ['MASTER_PORT'], flush=True)\nif attempt == '0':\n    raise SystemExit(3)\n")
    script = tmp_path / "train.py"
    write_job(str(script), 4, cell, Carried(), Launch(ranks=2, device="cpu", restarts=1, timeout=None, shared=()))
    srun = ("srun() { SLURM_PROCID=1 SLURM_NTASKS=2 SLURM_LOCALID=1 SLURM_NTASKS_PER_NODE=2 SLURM_JOB_ID=4242 "
            "MASTER_ADDR=127.0.0.1 \"$@\"; }")
    ran = subprocess.run(["bash", "-c", f'{srun}; . "$0"', str(tmp_path / "train.sbatch")], cwd=tmp_path,
                         env={**job_env(), "TAAS_REPO": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout == ("attempt 0 rank 1 of 2 local 1 2 at 127.0.0.1 24242\n"  # 20000 + the job id % 20000
                          "attempt 1 rank 1 of 2 local 1 2 at 127.0.0.1 24242\n")
    assert ran.stderr == "taas: the job failed (attempt 0 of 2)\n"
    assert os.listdir(tmp_path / "train.taas") == ["values.pt"]  # rank 1 leaves no names
