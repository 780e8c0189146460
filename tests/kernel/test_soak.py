"""Soak: 100 taas cells in one kernel, some failing, some interrupted, some with data workers,
most capturing a tensor from the notebook and binding one back.

The kernel's open file descriptors, threads, child processes and resident memory must
not grow beyond a small bound: every run is reaped and releases what it opened. The
cells start from warm spares (the default), which are counted apart: there are never
more than one cell's worth of them.
"""

import psutil
import pytest

from tests.kernel_client import Kernel, describe, left_after

CELLS = 100

SETUP = (
    "import torch, taas\n"
    "from torch.utils.data import DataLoader, TensorDataset\n"
    "loader = taas.register(DataLoader(TensorDataset(torch.arange(32)), batch_size=4))\n"
    "data = torch.rand(2**20)"  # made anew before each OK cell
)
# each captures the notebook's 4 MB `data` (made anew before it) and binds a 4 MB `out` back: runs that kept
# either would grow the kernel by 4 to 8 MB a cell (tests/kernel/test_memory.py for the 200 MB cases)
OK = ("#pragma taas --device cpu --gpus 2\nimport os\nvalue = int(os.environ['RANK']) + {i}\nout = data * 2 + {i}\n"
      "print('ok', {i})")
FAILING = "#pragma taas --device cpu --gpus 2\nraise ValueError('soak {i}')"
DATA = "#pragma taas --device cpu --gpus 2 --cpus 1\ntotal = sum(int(x.sum()) for (x,) in loader)\nprint('data', {i})"
INTERRUPTED = "#pragma taas --device cpu --gpus 2\nimport time\nprint('tick', flush=True)\ntime.sleep(60)"


def _footprint(kernel: Kernel) -> dict[str, float]:
    # garbage the cyclic collector has not reached yet, and what glibc keeps of freed memory (freed 4 MB
    # tensors stay in its heap once its mmap threshold has risen), are held by no one: collected and given
    # back before the memory is read, so that only what is held counts
    trimmed = kernel.execute("import ctypes, gc; gc.collect(); ctypes.CDLL(None).malloc_trim(0);")
    assert trimmed.reply["status"] == "ok"
    process = psutil.Process(kernel.pid)
    return {
        "fds": process.num_fds(),
        "threads": process.num_threads(),
        "children": len(kernel.children()),  # started for cells (waiting warm spares apart)
        "spares": len(kernel.spares()),
        "rss_mb": process.memory_info().rss / 2**20,
    }


def _interrupt(kernel: Kernel) -> None:
    msg_id, started = kernel.submit(INTERRUPTED)
    kernel.wait_for_stream(msg_id, "tick")
    kernel.manager.interrupt_kernel()
    ran = kernel.collect(msg_id, started)
    assert ran.error and ran.error["ename"] == "KeyboardInterrupt", ran.error_text()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_hundred_cells_leave_no_trace():
    kernel = Kernel()
    try:
        assert kernel.execute(SETUP).reply["status"] == "ok"
        for i in range(3):  # warm: the first cells import and cache what every later one reuses
            kernel.execute(OK.format(i=i))
            kernel.execute(DATA.format(i=i))
        kernel.execute(FAILING.format(i=-1))  # and the first failure and interrupt (the autopsy's imports)
        _interrupt(kernel)
        before = _footprint(kernel)
        outcomes = {"ok": 0, "error": 0, "interrupted": 0}
        for i in range(CELLS):
            if i % 10 == 7:
                _interrupt(kernel)
                outcomes["interrupted"] += 1
                continue
            cell = FAILING if i % 10 == 3 else DATA if i % 10 == 5 else OK
            if cell is OK:  # a new tensor each time: a run that kept what it captured would hold them all
                assert kernel.execute("data = torch.rand(2**20)").reply["status"] == "ok"
            ran = kernel.execute(cell.format(i=i))
            if cell is FAILING:
                assert "soak" in ran.error_text()
                outcomes["error"] += 1
            else:
                assert ran.reply["status"] == "ok", ran.error_text()
                outcomes["ok"] += 1
        assert not left_after(kernel, timeout=30)
        after = _footprint(kernel)
        assert outcomes == {"ok": 80, "error": 10, "interrupted": 10}
        assert after["children"] == 0, describe(kernel.children())
        assert after["spares"] <= 2, describe(kernel.spares())  # the warm spares for the next cell, never more
        assert after["fds"] <= before["fds"] + 4, (before, after)
        assert after["threads"] <= before["threads"] + 2, (before, after)
        assert after["rss_mb"] <= before["rss_mb"] + 20, (before, after)
        print(f"kernel footprint before {before}, after {CELLS} cells {after}")
    finally:
        kernel.shutdown()
