"""CUDA paths: NCCL ranks, the rank's own GPU, CUDA tensors back. Skipped without a GPU."""

import ast
import re
import time

import pytest
import torch

from tests.kernel_client import Kernel, assert_nothing_left

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def gpu_kernel():
    kernel = Kernel()
    yield kernel
    try:
        assert_nothing_left(kernel)
    finally:
        kernel.shutdown()


def test_one_rank_with_nccl_and_cuda_tensors_back(gpu_kernel):
    ran = gpu_kernel.execute(
        """#pragma taas --gpus 1
import torch, torch.distributed as dist
dist.init_process_group(backend="nccl", init_method="env://")
device = torch.device("cuda")
t = torch.ones(4, device=device) * (dist.get_rank() + 1)
dist.all_reduce(t)
print("backend", dist.get_backend(), "device", torch.cuda.current_device(), t.device)
dist.destroy_process_group()
t
"""
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    out = ran.stream("stdout")
    assert "1 GPU(s)" in out and "backend nccl device 0 cuda:0" in out
    # the kernel has CUDA here, so the tensor comes back on the GPU
    check = gpu_kernel.execute("print(t.device.type, t.sum().item())")
    assert check.stream("stdout") == "cuda 4.0\n"


def test_cuda_initialised_in_the_notebook_does_not_break_a_launch(gpu_kernel):
    gpu_kernel.execute("import torch\nwarm = torch.zeros(1, device='cuda')")
    ran = gpu_kernel.execute("#pragma taas --gpus 1\nimport torch\nprint(torch.zeros(1, device='cuda').device)")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert "cuda:0" in ran.stream("stdout")


def test_more_gpus_than_the_host_has_is_a_clear_error(gpu_kernel):
    too_many = torch.cuda.device_count() + 1
    ran = gpu_kernel.execute(f"#pragma taas --gpus {too_many}\nprint('ran')")
    assert ran.error["ename"] == "LaunchError"
    assert f"--gpus {too_many}" in ran.error_text() and "ran" not in ran.stream()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs: rank 1 is the isolated one")
def test_nccl_across_an_isolated_rank(gpu_kernel):
    ran = gpu_kernel.execute(
        """#pragma taas --gpus 2 --output all
import os, torch, torch.distributed as dist
dist.init_process_group(backend="nccl", init_method="env://")
t = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
dist.all_reduce(t)
torch.save(t.cpu(), "taas_gpu_write_rule.pt")
print("SUM", t.item(), torch.cuda.current_device())
dist.destroy_process_group()
"""
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    assert "[rank 0] SUM 3.0 0" in ran.stream("stdout") and "[rank 1] SUM 3.0 1" in ran.stream("stdout")
    assert "diverted (overlay)" in ran.stream("stdout")
    assert "rank 1 tried to change 1 path(s)" in ran.stream("stderr")
    import os

    os.remove("taas_gpu_write_rule.pt")


def test_a_cuda_ddp_model_comes_back_as_its_module_on_its_gpu(gpu_kernel):
    ran = gpu_kernel.execute(
        """#pragma taas --gpus 1
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group(backend="nccl", init_method="env://")
model = torch.nn.Linear(16, 4).cuda()
ddp_model = DDP(model, device_ids=[int(os.environ["LOCAL_RANK"])])
opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    ddp_model(torch.randn(8, 16, device="cuda")).sum().backward()
    opt.step()
big = torch.ones(64 * 2**20, device="cuda")  # 256 MB: through the memory file
ddp_model
"""
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    assert "ddp_model: DistributedDataParallel, came back as its module" in ran.stream("stdout")
    check = gpu_kernel.execute(
        "assert ddp_model is model and opt.param_groups[0]['params'][0] is model.weight\n"
        "print(model.weight.device, big.device, float(big.sum()))"
    )
    assert check.stream("stdout") == f"cuda:0 cuda:0 {float(64 * 2**20)}\n", check.error_text()


def test_a_captured_cuda_tensor_reaches_the_rank_on_its_device(gpu_kernel):
    gpu_kernel.execute("import torch\non_gpu = torch.arange(1000, device='cuda', dtype=torch.float32)")
    ran = gpu_kernel.execute("#pragma taas --gpus 1\nprint(on_gpu.device, float(on_gpu.sum()))\nscaled = on_gpu * 2")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert f"cuda:0 {float(sum(range(1000)))}" in ran.stream("stdout")
    check = gpu_kernel.execute("print(scaled.device, bool((scaled == on_gpu * 2).all()))")
    assert check.stream("stdout") == "cuda:0 True\n", check.error_text()


def test_a_search_on_the_gpus_gives_each_trial_its_own_slice_and_a_rerun_takes_warm_spares(gpu_kernel):
    pytest.importorskip("optuna")
    gpus = torch.cuda.device_count()
    cell = (f"#pragma taas --gpus 1 --trials {2 * gpus} --sampler random\n"
            "import os, time, torch, taas\n"
            "x = taas.trial().suggest_float('x', -1.0, 1.0)\n"
            "seen = (os.environ.get('CUDA_VISIBLE_DEVICES', 'all'), torch.cuda.device_count(),\n"
            "        str(torch.zeros(1, device='cuda').device))\n"
            "print('slice', seen, 'pid', os.getpid(), flush=True)\n"
            "time.sleep(1.0)\n"
            "taas.report(0, loss=x * x)\n"
            "gpu_search_seen = seen\n")
    ran = gpu_kernel.execute(cell, timeout=600)
    assert ran.reply["status"] == "ok", ran.error_text()
    assert f"{gpus} at a time" in ran.stream(), ran.stream()
    rows = gpu_kernel.execute("print(list(taas.trials()['state']))").stream()
    assert rows.strip() == str(["complete"] * (2 * gpus))
    visible, count, device = ast.literal_eval(gpu_kernel.execute("print(repr(gpu_search_seen))").stream())
    assert (count, device) == ((1, "cuda:0") if gpus > 1 else (gpus, "cuda:0")), (visible, count, device)
    if gpus < 2:
        return  # one GPU: trials one at a time, on the ordinary spares
    # after the search, one spare per slice waits, bound to its slice's GPU; a rerun's first trials take them
    deadline = time.monotonic() + 120
    while len(gpu_kernel.spares()) < gpus and time.monotonic() < deadline:
        time.sleep(0.5)
    waiting = {spare.pid for spare in gpu_kernel.spares()}
    assert len(waiting) == gpus, waiting
    again = gpu_kernel.execute(cell, timeout=600)
    assert again.reply["status"] == "ok", again.error_text()
    logs = gpu_kernel.execute("print('\\n'.join(taas.trials()['log']))").stream().split()
    pids = [int(found.group(1)) for log in logs if (found := re.search(r"slice .*? pid (\d+)", open(log).read()))]
    assert set(pids[:gpus]) <= waiting, (pids, waiting)
