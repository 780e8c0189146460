"""Kept cells' large names stay on rank 0 until the notebook touches them (transfer/keptnames.py), in a real
kernel with 2 CPU ranks: the notebook holds a proxy, a kept cell uses the ranks' own value with nothing sent,
the first touch copies it once, and the ranks' end on purpose copies what the notebook still names first."""

import psutil
import pytest

from tests.kernel_client import Kernel, assert_nothing_left

KEEP = "#pragma taas --gpus 2 --device cpu --keep"
MB = 2**20


@pytest.fixture(scope="module")
def lazy():
    """A kernel of its own whose kept cells leave names of 1 MiB or more on rank 0."""
    kernel = Kernel()
    ok(kernel, f"%config TaasMagics.lazy_bytes = {MB}")
    yield kernel
    kernel.shutdown()


@pytest.fixture()
def k(lazy):
    yield lazy
    ok(lazy, "%taas release")
    assert_nothing_left(lazy)


def ok(kernel: Kernel, code: str):
    ran = kernel.execute(code)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    return ran


def kernel_rss(kernel: Kernel) -> int:
    return psutil.Process(kernel.pid).memory_info().rss


def test_a_large_name_stays_on_rank_0_until_touched_and_a_kept_cell_uses_it_with_nothing_sent(k):
    ok(k, "import torch")  # the notebook's own torch, before its memory is measured
    before = kernel_rss(k)
    ok(k, f"""{KEEP}
import torch, torch.distributed as dist
big = torch.full((64 * 2**20,), 2.0)  # 256 MiB: not copied into the notebook
small = torch.arange(4)
""")
    assert kernel_rss(k) - before < 64 * MB  # nowhere near a copy of big
    shown = ok(k, "print(repr(big)); print(type(big).__name__, small.tolist())").stream("stdout")
    assert "<big: torch.Tensor, 268.4 MB, on rank 0 of the kept ranks, not copied here" in shown
    assert "OnTheRanks [0, 1, 2, 3]" in shown
    used = ok(k, f"{KEEP}\nprint('sum', float(big.sum()))\n").stream("stdout")
    assert "closure 0 B" in used and "sum 134217728.0" in used  # the ranks' own big, none of it sent
    touched = ok(k, "print('touched', float(big[:10].sum()), type(big).__name__)").stream("stdout")
    assert "touched 20.0 Tensor" in touched  # copied at the first touch, and bound in its place
    again = ok(k, f"{KEEP}\nprint('sum', float(big.sum()))\n").stream("stdout")
    assert "closure 0 B" in again  # the copy is what the ranks have: not sent back


def test_lazy_bytes_0_brings_every_name_back_at_once(k):
    ok(k, "%config TaasMagics.lazy_bytes = 0")
    try:
        ok(k, f"{KEEP}\nimport torch\nwhole = torch.ones(2**20)\n")
        assert ok(k, "print(type(whole).__name__)").stream("stdout") == "Tensor\n"
    finally:
        ok(k, f"%config TaasMagics.lazy_bytes = {MB}")


def test_a_name_a_returned_value_reaches_comes_back_with_it(k):
    ok(k, f"""{KEEP}
import torch
weights = torch.ones(2**19)
holder = {{"w": weights, "note": "small dict, big tensor"}}
""")  # holder reaches weights: both come back (weights would be loaded with it anyway)
    assert ok(k, "print(type(weights).__name__, holder['w'] is weights)").stream("stdout") == "Tensor True\n"


def test_release_copies_what_the_notebook_still_names_and_a_plain_cell_reads_a_copy(k):
    ok(k, f"{KEEP}\nimport torch\nlater = torch.full((2**19,), 3.0)\nother = torch.zeros(2**19)\n")
    ok(k, "del other")  # no longer named: not copied
    released = ok(k, "%taas release").stream("stdout")
    assert "released the kept ranks" in released
    assert ok(k, "print(type(later).__name__, float(later.sum()))").stream("stdout") == f"Tensor {3.0 * 2**19}\n"
    ok(k, f"{KEEP}\nimport torch\nmade = torch.full((2**19,), 5.0)\n")
    plain = ok(k, "#pragma taas --gpus 2 --device cpu\nprint('plain', float(made.sum()))\n").stream("stdout")
    assert f"plain {5.0 * 2**19}" in plain  # the proxy in its closure was copied first, and sent as the tensor


def test_a_proxy_whose_ranks_died_says_it_did_not_come_back(k):
    ran = ok(k, f"{KEEP} --output all\nimport os, torch\nlost = torch.ones(2**19)\nprint('pid', os.getpid())\n")
    import re

    for pid in re.findall(r"\[rank \d\] pid (\d+)", ran.stream()):
        psutil.Process(int(pid)).kill()
    psutil.wait_procs([psutil.Process(int(p)) for p in re.findall(r"\[rank \d\] pid (\d+)", ran.stream())
                       if psutil.pid_exists(int(p))], timeout=10)
    touched = k.execute("lost.sum()")
    assert touched.error is not None and touched.error["ename"] == "KeptNameLost"
    assert "lost (torch.Tensor, 2.1 MB) stayed on rank 0 of the kept ranks, which ended" in touched.error_text()
