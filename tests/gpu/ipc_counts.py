"""Why a captured CUDA tensor stays allocated in the kernel after the notebook deletes it (the one
failure of ``test_memory_gpu.py`` on the first H100 lend that ran it, 2026-11-27): torch's CUDA IPC
ref counter of each closure storage the kernel exported, read from its /dev/shm file at each step.

Not a test (pytest does not collect it): ``python tests/gpu/ipc_counts.py`` on a GPU machine, one
kernel, about 20 s. torch frees an exported storage the notebook dropped only once that counter is 0
or less (torch/csrc/CudaIPCTypes.cpp: above 0 it waits in torch's "limbo"); the counter starts at 1
per export, and each consumer's opened storage takes 1 off as it is freed (as does
``_release_ipc_counter``, which cudaipc.release calls for the kernel once the cell ends).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.kernel_client import Kernel

SPY = """
import gc, os, torch
from taas_magic.transfer import cudaipc
exported, released = [], []
_export, _release = cudaipc.export, cudaipc.release
def _spy_export(blobs, indices):
    handles, why = _export(blobs, indices)
    exported.extend(handles.values())
    return handles, why
def _spy_release(handles):
    handles = list(handles)
    released.extend(handles)
    return _release(handles)
cudaipc.export, cudaipc.release = _spy_export, _spy_release
def counts():
    out = []
    for h in exported:
        try:
            with open('/dev/shm/' + h[4].decode().lstrip('/'), 'rb') as f:
                f.seek(8 * h[5]); out.append(int.from_bytes(f.read(8), 'little', signed=True))
        except OSError as exc:
            out.append(type(exc).__name__)
    return out
def mib():
    gc.collect(); torch.cuda.synchronize(); return torch.cuda.memory_allocated() // 2**20
warm = torch.zeros(1, device='cuda')
"""

STEPS = [
    ("before", "print(mib())"),
    ("x made", "x = torch.ones(64 * 2**20, device='cuda'); print(mib())"),
    ("taas cell", "#pragma taas --gpus 1\ny = x * 2\nfirst = float(y[0])\n"),
    ("after the cell", "print(mib(), 'exported', len(exported), 'released', len(released), 'counts', counts())"),
    ("del x, y", "del x, y; print(mib(), 'counts', counts())"),
    ("ipc_collect", "torch.cuda.ipc_collect(); print(mib(), 'counts', counts())"),
    ("captured, not returned", "x = torch.ones(64 * 2**20, device='cuda'); print(mib())"),
    ("taas cell 2", "#pragma taas --gpus 1\ntotal = float(x.sum())\n"),
    ("after cell 2", "print(mib(), 'counts', counts(), 'x came back as a new tensor:', x.data_ptr())"),
    ("del x", "del x; torch.cuda.ipc_collect(); print(mib(), 'counts', counts())"),
]


def main() -> None:
    kernel = Kernel()
    try:
        assert kernel.execute(SPY).reply["status"] == "ok"
        for label, code in STEPS:
            ran = kernel.execute(code, timeout=90)
            text = (ran.stream("stdout") + ran.stream("stderr")).strip().replace("\n", " | ")
            print(f"{label:24} {ran.reply['status']:5} {text[-400:]}", flush=True)
    finally:
        kernel.shutdown()


if __name__ == "__main__":
    main()
