"""A run forgets what it captured: once a run has ended and its names are bound (or will never be),
nothing of taas keeps its closure, its packed tensors or its results, so a tensor the notebook
deletes is freed at once and the kernel's memory comes back (kernel/runs/background.py's let_go).

Each test binds a 200 MB tensor in a kernel of its own, runs a taas cell that reads it (or binds
one from rank 0), deletes the notebook's name and checks two things: the tensor's storage is gone
(a weak reference to it, torch's ``StorageWeakRef``, has expired: no object anywhere keeps it) and
the kernel's resident memory is within 10% of where it was before the tensor was made. The soak
(tests/kernel/test_soak.py) holds the same over 100 cells.
"""

from __future__ import annotations

import pytest

from tests.kernel_client import Kernel, assert_nothing_left

MB = 2**20
SETUP = """
import ctypes, gc, psutil, taas, torch
from torch.multiprocessing.reductions import StorageWeakRef  # a weak reference to the storage itself
def rss():
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # what the allocator keeps of freed memory is not held by anyone
    return psutil.Process().memory_info().rss
"""
BIG = "x = torch.ones(50 * 2**20); x_ref = StorageWeakRef(x.untyped_storage())"  # 200 MB
READS_X = "#pragma taas --device cpu --gpus 2 {extra}\n{body}\nfirst = float(x[0])\n"


def _value(kernel, expression: str):
    ran = kernel.execute(expression)
    assert ran.reply["status"] == "ok", ran.error_text()
    return eval(ran.result["text/plain"])  # noqa: S307 - our own kernel's repr of a number or bool


@pytest.fixture(scope="module")
def memory_kernel():
    """A kernel of this module's own (nothing else's runs in its memory), after one small taas cell
    (its imports and spares settled). Each test leaves it as it found it: that is what it checks."""
    kernel = Kernel()
    try:
        assert kernel.execute(SETUP).reply["status"] == "ok"
        warm = kernel.execute(READS_X.format(extra="", body="x = 1").replace("float(x[0])", "x"))
        assert warm.reply["status"] == "ok", warm.error_text()
        yield kernel
        assert_nothing_left(kernel)
    finally:
        kernel.shutdown()


def _ready(kernel):
    """The kernel and its memory now: the baseline."""
    return kernel, _value(kernel, "rss()")


def _freed(kernel, baseline: int, name: str = "x") -> None:
    """``name`` deleted in the notebook: its storage is gone and the kernel's memory is back within 10%."""
    assert kernel.execute(f"del {name}").reply["status"] == "ok"
    assert _value(kernel, f"gc.collect() and None; {name}_ref.expired()") is True, \
        f"after `del {name}`, something still holds its 200 MB storage"
    now = _value(kernel, "rss()")
    assert now < baseline * 1.10, f"the kernel holds {(now - baseline) / MB:.0f} MB more than before the tensor"


def test_tensors_captured_in_several_cells_are_freed_when_the_notebook_deletes_them(memory_kernel):
    kernel, baseline = _ready(memory_kernel)
    for _ in range(3):
        assert kernel.execute(BIG).reply["status"] == "ok"
        ran = kernel.execute(READS_X.format(extra="", body=""))
        assert ran.reply["status"] == "ok", ran.error_text()
        _freed(kernel, baseline)
    assert _value(kernel, "first") == 1.0


def test_results_bound_then_deleted_are_freed(memory_kernel):
    kernel, baseline = _ready(memory_kernel)
    ran = kernel.execute("#pragma taas --device cpu --gpus 2\ny = torch.full((50 * 2**20,), 2.0)\n")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert _value(kernel, "y_ref = StorageWeakRef(y.untyped_storage()); float(y.sum())") == 2.0 * 50 * MB
    _freed(kernel, baseline, "y")


def test_a_failed_run_lets_go(memory_kernel):
    kernel, baseline = _ready(memory_kernel)
    assert kernel.execute(BIG).reply["status"] == "ok"
    ran = kernel.execute(READS_X.format(extra="", body="raise ValueError('on purpose')"))
    assert ran.error is not None and "on purpose" in ran.error_text()
    _freed(kernel, baseline)


def test_an_interrupted_run_lets_go(memory_kernel):
    kernel, baseline = _ready(memory_kernel)
    assert kernel.execute(BIG).reply["status"] == "ok"
    msg_id, started = kernel.submit(READS_X.format(extra="", body="import time\nprint('sleeping', flush=True)\n"
                                                                   "time.sleep(60)"))
    kernel.wait_for_stream(msg_id, "sleeping")
    kernel.manager.interrupt_kernel()
    assert kernel.collect(msg_id, started).error["ename"] == "KeyboardInterrupt"
    _freed(kernel, baseline)


def test_a_detached_run_lets_go_once_waited_for(memory_kernel):
    kernel, baseline = _ready(memory_kernel)
    assert kernel.execute(BIG).reply["status"] == "ok"
    assert kernel.execute(READS_X.format(extra="--detach", body="")).reply["status"] == "ok"
    waited = kernel.execute("%taas wait")
    assert waited.reply["status"] == "ok", waited.error_text()
    _freed(kernel, baseline)


def test_a_searchs_trials_let_go(memory_kernel):
    pytest.importorskip("optuna")
    kernel, baseline = _ready(memory_kernel)
    assert kernel.execute(BIG).reply["status"] == "ok"
    body = "lr = taas.trial().suggest_float('lr', 0.1, 1.0)\ntaas.report(0, loss=lr)"
    ran = kernel.execute(READS_X.format(extra="--trials 3", body=body))
    assert ran.reply["status"] == "ok", ran.error_text()
    _freed(kernel, baseline)

