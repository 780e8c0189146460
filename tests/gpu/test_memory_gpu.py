"""A run forgets what it captured, on the GPU: a CUDA tensor the notebook captured (sent to the ranks
by CUDA IPC or the memory file) or that rank 0 sent back is freed on the device once the notebook
deletes it; ``torch.cuda.memory_allocated`` in the kernel comes back to where it was. Skipped without
a GPU (the CPU contract is tests/kernel/test_memory.py)."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SETUP = ("import gc, torch\nfrom torch.multiprocessing.reductions import StorageWeakRef\n"
         "warm = torch.zeros(1, device='cuda')\n"
         "def allocated():\n    gc.collect()\n    return torch.cuda.memory_allocated()\n")


def _value(kernel, expression: str):
    ran = kernel.execute(expression)
    assert ran.reply["status"] == "ok", ran.error_text()
    return eval(ran.result["text/plain"])  # noqa: S307 - our own kernel's repr of a number or bool


@pytest.mark.parametrize("gpus", [1, 2])
def test_cuda_tensors_captured_and_bound_back_are_freed_on_the_device(new_kernel, gpus):
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    kernel = new_kernel()
    assert kernel.execute(SETUP).reply["status"] == "ok"
    before = _value(kernel, "allocated()")
    for _ in range(3):
        assert kernel.execute("x = torch.ones(64 * 2**20, device='cuda'); x_ref = StorageWeakRef(x.untyped_storage())"
                              ).reply["status"] == "ok"
        ran = kernel.execute(f"#pragma taas --gpus {gpus}\ny = x * 2\nfirst = float(y[0])\n")
        assert ran.reply["status"] == "ok", ran.error_text()
        assert _value(kernel, "y_ref = StorageWeakRef(y.untyped_storage()); first") == 2.0
        assert kernel.execute("del x, y").reply["status"] == "ok"
        assert _value(kernel, "gc.collect() and None; (x_ref.expired(), y_ref.expired())") == (True, True)
        assert _value(kernel, "allocated()") == before, "the device still holds what the notebook deleted"
