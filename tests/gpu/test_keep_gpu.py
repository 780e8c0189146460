"""Kept ranks on GPUs (``--keep``): the NCCL group, each rank's CUDA tensors and its compiled function stay from
cell to cell, a plain cell is refused the GPUs they hold, and ``%taas release`` gives the GPU memory back.
Skipped without 2 CUDA GPUs; written without a GPU to run it on: the first session lent one runs it (the CPU
twin is tests/kernel/test_keep.py)."""

import re

import pytest
import torch

from tests.kernel_client import Kernel, assert_nothing_left

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

KEEP = "#pragma taas --gpus 2 --keep --output all\n"


def test_an_nccl_group_and_cuda_tensors_stay_across_kept_cells_until_released():
    kernel = Kernel()
    try:
        first = kernel.execute(KEEP + "import os, torch, torch.distributed as dist\ndist.init_process_group('nccl')\n"
                               "big = torch.full((1 << 26,), float(dist.get_rank()), device='cuda')\n"
                               "print('pid', os.getpid(), torch.cuda.current_device())\n", timeout=300)
        assert first.reply["status"] == "ok", first.error_text()
        pids = dict(re.findall(r"\[rank (\d)\] pid (\d+ \d)", first.stream()))
        assert len(pids) == 2 and pids["0"].endswith(" 0") and pids["1"].endswith(" 1")
        second = kernel.execute(KEEP + "dist.all_reduce(big)\nprint('pid', os.getpid(), torch.cuda.current_device(), "
                                "'sum', big[0].item())\n", timeout=300)
        assert second.reply["status"] == "ok", second.error_text()
        for rank, pid in pids.items():
            assert f"[rank {rank}] pid {pid} sum 1.0" in second.stream(), second.stream()
        status = kernel.execute("%taas status").stream()
        assert "MiB on GPU 1" in status, status  # rank 1's 256 MiB tensor, on its own GPU
        refused = kernel.execute("#pragma taas --gpus 2\npass")
        assert "the kept ranks (2 rank(s) on auto, this host) hold this host's GPUs" in refused.error_text()
        released = kernel.execute("%taas release")
        assert "released the kept ranks" in released.stream()
        assert_nothing_left(kernel)
    finally:
        kernel.shutdown()
