"""``%taas export``'s Ray entry point on a real Ray cluster of two nodes on this machine: a notebook's 2-rank cell,
exported, run as ``python train_ray.py`` against the cluster; one actor per rank runs the script as that rank, and
the job trains the notebook's bit-identical weights, only rank 0's file landing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.kernel.test_export import same_weights, train_and_export
from tests.kernel_client import Kernel

pytestmark = pytest.mark.ray
cluster_utils = pytest.importorskip("ray.cluster_utils", reason='the Ray entry point needs Ray: pip install "taas-magic[ray]"')


def test_the_exported_ray_job_trains_the_notebooks_weights_with_one_actor_per_rank(tmp_path):
    kernel = Kernel(cwd=str(tmp_path))
    try:
        train_and_export(kernel, tmp_path)
    finally:
        kernel.shutdown()
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ran = subprocess.run([sys.executable, str(tmp_path / "job" / "train_ray.py")], cwd=tmp_path,
                             env={**os.environ, "RAY_ADDRESS": cluster.address}, capture_output=True, text=True,
                             timeout=240)
    finally:
        cluster.shutdown()
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert "trained" in ran.stdout + ran.stderr
    assert same_weights(tmp_path / "weights.pt", tmp_path / "notebook-weights.pt")
    assert torch.load(tmp_path / "who.pt")["rank"] == 0
