"""The quickstart notebook runs end to end with the README's command, unchanged."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from taas_magic.launch.rankenv import AUTO_CPU_RANKS, visible_gpu_count

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_notebook_runs_end_to_end(tmp_path):
    """Whatever the host: --gpus auto is one rank per GPU, or 2 CPU ranks without GPUs."""
    world = visible_gpu_count() or AUTO_CPU_RANKS
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", tmp_path)
    try:  # within pytest-timeout's 300 s, so that what the notebook printed until then is in the failure
        run = subprocess.run(
            [sys.executable, str(ROOT / "notebooks" / "run.py"), str(tmp_path / "quickstart.ipynb")],
            capture_output=True, text=True, timeout=240,
        )
    except subprocess.TimeoutExpired as late:
        pytest.fail(f"the quickstart did not end within 240 s; it printed:\n{late.stdout}\n{late.stderr}")
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    why = "one per GPU of this host" if visible_gpu_count() else "no GPU on this host, so 2 CPU ranks to show DDP"
    assert f"taas: {world} rank(s) (--gpus auto: {why})" in out and "config g2.8" in out
    assert "epoch 2" in out and "saved mnist_cnn.pt" in out
    assert "saved file holds rank 0's weights: True" in out
    steps = 2 * -(-1024 // (64 * world))  # 2 epochs of 1024 samples, 64 per rank and step
    assert f"{steps} loss reports from rank 0, last" in out  # taas.report(loss=tensor), back as taas.metrics()
    if world > 1:  # the unguarded save ran on every rank; rank 1's was diverted and reported
        assert "taas: rank 1 tried to change 1 path(s) in the repository" in run.stderr and "mnist_cnn.pt" in run.stderr
    accuracy = float(out.split("test accuracy ")[1].split(";")[0])
    assert accuracy > 0.9  # the synthetic classes are easy: the model really trained
    state = torch.load(tmp_path / "mnist_cnn.pt")
    assert state["fc2.weight"].shape == (10, 128)
    assert not list(Path(os.getcwd()).glob("mnist_cnn.pt"))


@pytest.mark.minimums
def test_kernelspec_python3_taas_loads_the_extension(new_kernel):
    from jupyter_client.kernelspec import KernelSpecManager

    specs = KernelSpecManager().find_kernel_specs()
    assert "taas" in specs, "install the package (pip install .) or see the README's kernelspec line"
    assert KernelSpecManager().get_kernel_spec("taas").display_name == "Python 3 (taas)"
    taas_kernel = new_kernel(kernel_name="taas", load_ext=False)
    first = taas_kernel.execute("%load_ext taas_magic")  # the quickstart's first cell, written for any kernel
    assert first.reply["status"] == "ok" and first.stream() == "", first.stream()  # no "already loaded"
    ran = taas_kernel.execute("#pragma taas --device cpu --gpus 1\nimport os\nos.environ['WORLD_SIZE']")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert ran.result["text/plain"] == "'1'"
