"""CUDA tensors at device speed: CUDA IPC both ways, and the memory file when it cannot serve.
Skipped without a GPU (the CPU contract is tests/unit/test_cudaipc.py).

With ``expandable_segments:True`` torch shares a segment through ``pidfd_getfd`` on the
exporter: the kernel may do that to rank 0 (its descendant) where ptrace rules allow, a rank
to the kernel (its ancestor) only where they are loose. Each test asks the host first and
expects CUDA IPC where the host allows it, the memory file with its reason where it does not.
"""

import ctypes
import errno
import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

N = 64 * 2**20  # float32 elements: 256 MiB
SYS_PIDFD_GETFD = 438  # the same number on x86_64 and arm64
ALLOC = {False: "expandable_segments:False", True: "expandable_segments:True"}
WARM = "import torch\nwarm = torch.zeros(1, device='cuda')"  # the kernel has CUDA: the probe says yes


_PROBE = f"""
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
pidfd = os.pidfd_open(int(sys.argv[1]))
fd = libc.syscall({SYS_PIDFD_GETFD}, pidfd, 0, 0)
sys.exit(0 if fd >= 0 or ctypes.get_errno() == errno.EBADF else 1)  # EBADF: allowed, no such fd
"""


def _getfd_allowed(on_parent: bool) -> bool:
    """Whether a process may take a file descriptor of its child (``on_parent``: of its parent) by
    pidfd_getfd, as torch does for ``expandable_segments:True`` (the kernel of rank 0; a rank of the kernel)."""
    if on_parent:
        return subprocess.run([sys.executable, "-c", _PROBE, str(os.getpid())], check=False).returncode == 0
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        return _getfd_from_here(child.pid)
    finally:
        child.kill()
        child.wait()


def _getfd_from_here(pid: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, 0, 0)
        if fd >= 0:
            os.close(fd)
        return fd >= 0 or ctypes.get_errno() == errno.EBADF
    finally:
        os.close(pidfd)


def _dead_torch_counter_files() -> set[str]:
    """torch's CUDA IPC ref-counter files in /dev/shm whose process is gone."""
    found = set()
    for name in os.listdir("/dev/shm"):
        match = re.match(r"torch_(\d+)_", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            found.add(name)
    return found


@pytest.mark.parametrize("expandable", [False, True], ids=["plain", "expandable"])
def test_a_cuda_result_comes_back_device_to_device(new_kernel, expandable):
    kernel = new_kernel(env={"PYTORCH_CUDA_ALLOC_CONF": ALLOC[expandable]})
    assert kernel.execute(WARM).reply["status"] == "ok"
    before = _dead_torch_counter_files()
    ran = kernel.execute(f"#pragma taas --gpus 1\nimport torch\nbig = torch.arange({N}, device='cuda', dtype=torch.float32)")
    assert ran.reply["status"] == "ok", ran.error_text()
    err = ran.stream("stderr")
    if not expandable or _getfd_allowed(on_parent=False):  # information: stdout (a fall-back is a warning: stderr)
        assert "taas: 1 CUDA tensor(s), 268.4 MB, came back device to device (CUDA IPC)" in ran.stream("stdout"), ran.stream()
    else:
        assert "taas: 1 CUDA tensor(s), 268.4 MB, came back through host memory (" in err, err
    check = kernel.execute(f"print(big.device, bool((big == torch.arange({N}, device='cuda', dtype=torch.float32)).all()))")
    assert check.stream("stdout") == "cuda:0 True\n", check.error_text()
    assert _dead_torch_counter_files() <= before  # rank 0 left no ref-counter file behind


def _shipping(new_kernel, env: dict[str, str]):
    """A kernel (CUDA initialised) whose notebook holds ``shipped``, N float32 on cuda:0, for a cell to capture."""
    kernel = new_kernel(env=env)
    setup = kernel.execute(WARM + f"\nshipped = torch.arange({N}, device='cuda', dtype=torch.float32)")
    assert setup.reply["status"] == "ok", setup.error_text()
    return kernel


@pytest.mark.parametrize("expandable", [False, True], ids=["plain", "expandable"])
def test_a_captured_cuda_tensor_reaches_the_rank_device_to_device(new_kernel, expandable):
    kernel = _shipping(new_kernel, {"PYTORCH_CUDA_ALLOC_CONF": ALLOC[expandable]})
    ran = kernel.execute(
        "#pragma taas --gpus 1\n"
        f"ok = bool((shipped == torch.arange({N}, device='cuda', dtype=torch.float32)).all())\n"
        "print('RANK', shipped.device, ok)\n"
        "shipped.mul_(2)  # the rank's own copy: the notebook's tensor is not written through\n"
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    out, err = ran.stream("stdout"), ran.stream("stderr")
    assert "RANK cuda:0 True" in out and "(CUDA IPC)" in out, out  # the header names the way
    if not expandable or _getfd_allowed(on_parent=True):
        assert "could not open the closure's CUDA tensors" not in err, err
    else:
        assert "taas: rank 0 could not open the closure's CUDA tensors by CUDA IPC (" in err, err
    # rank 0 changed its copy in place: it comes back, and the notebook's is the new value
    check = kernel.execute(f"print(bool((shipped == 2 * torch.arange({N}, device='cuda', dtype=torch.float32)).all()))")
    assert check.stream("stdout") == "True\n", check.error_text()


def test_with_cuda_ipc_off_the_memory_file_serves_the_same_values(new_kernel):
    kernel = _shipping(new_kernel, {"TAAS_CUDA_IPC": "0"})
    ran = kernel.execute(
        "#pragma taas --gpus 1\n"
        f"print('RANK', shipped.device, bool((shipped == torch.arange({N}, device='cuda', dtype=torch.float32)).all()))\n"
        "back = shipped + 1\n"
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    out, err = ran.stream("stdout"), ran.stream("stderr")
    assert "RANK cuda:0 True" in out and "(one shared file)" in out and "CUDA IPC)" not in out, out
    # `back`, and `shipped` too: rank 0 cannot yet tell an unchanged captured CUDA tensor (docs/limits.md)
    assert "taas: 2 CUDA tensor(s), 536.9 MB, came back through host memory (TAAS_CUDA_IPC=0)" in err, err
    check = kernel.execute(f"print(back.device, bool((back == torch.arange({N}, device='cuda', dtype=torch.float32) + 1).all()))")
    assert check.stream("stdout") == "cuda:0 True\n", check.error_text()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_tensor_on_cuda_0_reaches_rank_1_on_cuda_1(new_kernel):
    kernel = new_kernel()
    setup = kernel.execute(WARM + "\nshipped = torch.arange(1 << 20, device='cuda:0', dtype=torch.float32)")
    assert setup.reply["status"] == "ok", setup.error_text()
    ran = kernel.execute(
        "#pragma taas --gpus 2 --output all\n"
        "expected = torch.arange(1 << 20, dtype=torch.float32, device=torch.cuda.current_device())\n"
        "print('ON', shipped.device, bool((shipped == expected).all()))\n"
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    out = ran.stream("stdout")
    assert "[rank 0] ON cuda:0 True" in out and "[rank 1] ON cuda:1 True" in out, out
    assert "(CUDA IPC)" in out, out
