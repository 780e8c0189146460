"""``%taas export``'s sbatch job on the real multi-node Slurm of tests/slurm/minislurm.py: a notebook's 2-rank cell,
exported, submitted with ``sbatch --wait``; its ranks started by ``srun`` take Slurm's variables, train the
notebook's bit-identical weights, and only rank 0's file lands."""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.kernel.test_export import same_weights, train_and_export, without_jupyter
from tests.kernel_client import Kernel

pytestmark = pytest.mark.slurm


def test_the_exported_sbatch_job_trains_the_notebooks_weights_and_only_rank_0s_file_lands(slurm, tmp_path):
    kernel = Kernel(cwd=str(tmp_path))
    try:
        train_and_export(kernel, tmp_path)
    finally:
        kernel.shutdown()
    env = {**without_jupyter(tmp_path), "SLURM_CONF": slurm.env()["SLURM_CONF"]}
    env = {name: value for name, value in env.items() if not name.startswith("SLURM_") or name == "SLURM_CONF"}
    submitted = subprocess.run(["sbatch", "--wait", "--parsable", str(tmp_path / "job" / "train.sbatch")], cwd=tmp_path,
                               env=env, capture_output=True, text=True, timeout=240)
    job = submitted.stdout.strip().split(";")[0]
    log = tmp_path / "job" / "train.taas" / f"slurm-{job}.out"
    said = log.read_text() if log.exists() else "(no log)"
    assert submitted.returncode == 0, submitted.stderr + said
    assert "trained" in said
    assert same_weights(tmp_path / "weights.pt", tmp_path / "notebook-weights.pt")
    assert torch.load(tmp_path / "who.pt")["rank"] == 0
