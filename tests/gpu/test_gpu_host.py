"""A GPU host end to end: the quickstart, warm spares bound to their GPUs, a restart with CUDA state,
``--device cpu`` and ``--gpus auto``, and ``taas.report`` of CUDA tensors without a sync. Skipped
without a GPU. Every cell here must also leave no "Warning" in the cell's stderr."""

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.kernel_client import Kernel, assert_nothing_left

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
AUTO = f"taas: {GPUS} rank(s) (--gpus auto: one per GPU of this host)"
ON_GPUS = f"{GPUS} GPU(s) of {GPUS}, backend nccl"
KERNEL_LOG = re.compile(r"^\[\w+App\] ")  # the kernel process's own log lines (run.py's stderr carries them)


@pytest.fixture(scope="module")
def gpu_kernel(tmp_path_factory):
    """One kernel for the module, in a folder of its own (the write rule's repository, the checkpoints)."""
    kernel = Kernel(cwd=str(tmp_path_factory.mktemp("gpu-host")))
    yield kernel
    try:
        assert_nothing_left(kernel)
    finally:
        kernel.shutdown()


@pytest.fixture(autouse=True)
def nothing_left_running(request):
    yield
    if "gpu_kernel" in request.fixturenames:
        assert_nothing_left(request.getfixturevalue("gpu_kernel"))


def clean(ran):
    """The cell succeeded and nothing raised a warning into its stderr."""
    assert ran.reply["status"] == "ok", ran.error_text()
    assert "Warning" not in ran.stream("stderr"), ran.stream("stderr")
    return ran


def first_line_at(ran, needle: str) -> float:
    return next(m.at for m in ran.messages if m.type == "stream" and needle in m.content["text"])


def warm_spares(kernel: Kernel, count: int, timeout: float = 120) -> list:
    """The kernel's spares once ``count`` of them are warm and waiting (named taas-spare)."""
    deadline = time.monotonic() + timeout
    while True:
        waiting = []
        for spare in kernel.spares():
            try:
                if spare.name() == "taas-spare":
                    waiting.append(spare)
            except Exception:  # noqa: BLE001 - it was taken or stopped meanwhile
                pass
        if len(waiting) >= count or time.monotonic() > deadline:
            return waiting
        time.sleep(0.1)


def pids_on_gpus() -> set[int] | None:
    """Processes holding a CUDA context, as nvidia-smi (else NVML through torch) reports them;
    None where neither can tell, or where they cannot see this very process (which has a
    context by now): a container's PID namespace, say."""
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    found: set[int] = set()
    if shutil.which("nvidia-smi"):
        run = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
        if run.returncode == 0:
            found = {int(word) for word in run.stdout.split() if word.isdigit()}
    if os.getpid() not in found:
        try:
            listed = "\n".join(torch.cuda.list_gpu_processes(device) for device in range(GPUS))
        except Exception:  # noqa: BLE001 - no NVML here
            listed = ""
        found = {int(pid) for pid in re.findall(r"process\s+(\d+)\s+uses", listed)}
    return found if os.getpid() in found else None


def test_the_quickstart_notebook_on_the_gpus(tmp_path):
    shutil.copy(ROOT / "notebooks" / "quickstart.ipynb", tmp_path)
    run = subprocess.run([sys.executable, str(ROOT / "notebooks" / "run.py"), str(tmp_path / "quickstart.ipynb")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert AUTO in out and ON_GPUS in out and "config g2.8" in out
    assert "epoch 2" in out and "saved mnist_cnn.pt" in out and "saved file holds rank 0's weights: True" in out
    steps = 2 * -(-1024 // (64 * GPUS))  # 2 epochs of 1024 samples, 64 per rank and step
    assert f"{steps} loss reports from rank 0, last" in out  # taas.report(loss=<CUDA tensor>), whole
    assert float(out.split("test accuracy ")[1].split(";")[0]) > 0.9
    cells_stderr = [line for line in run.stderr.splitlines() if not KERNEL_LOG.match(line)]
    assert not [line for line in cells_stderr if "Warning" in line], run.stderr


def test_a_warm_spare_waits_bound_to_its_gpu(gpu_kernel):
    clean(gpu_kernel.execute("#pragma taas --gpus auto\nimport torch\nx = torch.ones(2, device='cuda').sum().item()"))
    waiting = warm_spares(gpu_kernel, GPUS)
    assert len(waiting) == GPUS, [spare.pid for spare in waiting]
    status = clean(gpu_kernel.execute("%taas status")).stream("stdout")
    line = next((line for line in status.splitlines() if line.startswith("warm spares:")), "")
    assert re.search(rf"\b{GPUS} waiting\b", line), status
    on_gpus = pids_on_gpus()
    if on_gpus is not None:  # else this host cannot say which processes hold a context
        assert {spare.pid for spare in waiting} <= on_gpus, (on_gpus, [spare.pid for spare in waiting])


PID_CELL = "#pragma taas --gpus auto\nimport os\nprint('pid', os.getpid(), flush=True)\n"


def test_a_cell_within_a_second_of_the_last_takes_its_spares(new_kernel, tmp_path):
    kernel = new_kernel(cwd=str(tmp_path))
    first = clean(kernel.execute(PID_CELL))  # cold: fresh processes
    spares = {spare.pid for spare in kernel.spares()}  # started as the cell ended, perhaps still warming
    second = clean(kernel.execute(PID_CELL))
    assert len(spares) == GPUS and int(second.stream("stdout").split("pid ")[1].split()[0]) in spares
    # it waits for what is left of their warm-up, never for more than a fresh start
    assert first_line_at(second, "pid ") < first_line_at(first, "pid ") + 2.0
    warm_spares(kernel, GPUS)
    third = clean(kernel.execute(PID_CELL))
    assert first_line_at(third, "pid ") < 2.0  # warm and bound: no interpreter, no torch import, no context


RESTARTING = """#pragma taas --gpus auto --restarts 1
import os, time, torch, taas
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
state = taas.load_checkpoint()
if attempt == 0:
    assert state is None
    taas.save_checkpoint({"weights": torch.arange(4, device="cuda", dtype=torch.float32) * 1.5, "attempt": 0})
    if os.environ["RANK"] == "0":
        os.kill(os.getpid(), 9)
    time.sleep(60)
weights = state["weights"]
print("loaded", attempt, weights.device, weights.tolist(), state["attempt"], flush=True)
"""


def test_a_restart_resumes_from_a_cuda_checkpoint(gpu_kernel):
    ran = clean(gpu_kernel.execute(RESTARTING, timeout=300))
    assert "rank 0 was killed by SIGKILL" in ran.stream("stderr")
    assert "loaded 1 cuda:0 [0.0, 1.5, 3.0, 4.5] 0" in ran.stream("stdout")


def test_device_cpu_on_a_gpu_host_hides_the_gpus_and_serves_nccl_with_gloo(gpu_kernel):
    ran = clean(gpu_kernel.execute(
        "#pragma taas --device cpu --gpus 2\nimport os, torch, torch.distributed as dist\n"
        "dist.init_process_group('nccl', init_method='env://')\n"
        "print('seen', repr(os.environ.get('CUDA_VISIBLE_DEVICES')), torch.cuda.is_available(), dist.get_backend())\n"
        "dist.destroy_process_group()"
    ))
    out = ran.stream("stdout")
    assert "CPU (--device cpu), backend gloo" in out.splitlines()[0], out
    assert "seen '' False gloo" in out


def test_gpus_auto_is_one_rank_per_gpu_and_says_why(gpu_kernel):
    ran = clean(gpu_kernel.execute(
        "#pragma taas --gpus auto --output all\nimport os, torch\n"
        "print('world', os.environ['WORLD_SIZE'], torch.cuda.current_device())"
    ))
    out = ran.stream("stdout")
    header = out.splitlines()[0]
    assert header.startswith(AUTO) and ON_GPUS in header, header
    for rank in range(GPUS):
        assert f"[rank {rank}] world {GPUS} {rank}" in out, out


REPORTING = """#pragma taas --gpus auto
import taas, torch
w = torch.randn(2048, 2048, device="cuda") / 64
x = torch.randn(2048, 2048, device="cuda")
half = torch.full((), 0.5, device="cuda")
torch.cuda.synchronize()
import warnings  # torch's own note that this debug mode is a prototype is not taas's warning
warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
torch.cuda.set_sync_debug_mode("error")  # any step that waited for the GPU raises (the reports' thread too)
try:
    for step in range(200):
        x = torch.tanh(x @ w)  # GPU work queued ahead of the report's copy
        taas.report(loss=half * step + x[0, 0] * 0, lr=0.1)
finally:
    torch.cuda.set_sync_debug_mode("default")
"""


def test_cuda_tensors_reported_every_step_arrive_whole_without_a_sync(gpu_kernel):
    clean(gpu_kernel.execute(REPORTING))
    check = clean(gpu_kernel.execute(
        "import taas\nm = taas.metrics()\n"
        "print(len(m), m == [{'step': i, 'loss': i * 0.5, 'lr': 0.1} for i in range(200)], m[:2], m[-1:])"
    ))
    assert check.stream("stdout").startswith("200 True"), check.stream("stdout")
