"""The hang autopsy over a real kernel: when --timeout fires or the cell is interrupted, every rank
still running shows its stack at its cell lines, and one line says where each rank is."""

import time

import pytest

from tests.kernel_client import warm_up

HUNG = """\
#pragma taas --device cpu --gpus 2 --timeout {timeout}
import os, time, ctypes, torch, torch.distributed as dist
dist.init_process_group("gloo")
print("both ranks in", flush=True)
if dist.get_rank() == 1:
    {stuck}
t = torch.ones(2)
dist.all_reduce(t)
"""


@pytest.mark.parametrize(
    ("stuck", "where"),
    [
        ("time.sleep(100)", "rank 1 is at line 6 in time.sleep"),
        # blocked in C holding the GIL: no Python thread or handler of the rank could answer
        ("ctypes.PyDLL(None).sleep(100)", "rank 1 is at line 6 in ctypes.PyDLL(None).sleep"),
    ],
)
def test_a_timeout_shows_where_every_running_rank_is(kernel, stuck, where):
    warm_up(kernel)  # both ranks are at their lines well within the 6 s, however loaded the machine
    started = time.monotonic()
    ran = kernel.execute(HUNG.format(timeout=6, stuck=stuck))
    took = time.monotonic() - started
    assert ran.error["ename"] == "RunTimeout"
    text = ran.error_text()
    assert "taas: the run passed --timeout 6s; ranks still running: 0, 1" in text
    summary = f"taas: where the running ranks were: rank 0 waits in all_reduce (line 8); {where}"
    assert summary in text, text
    assert "--- rank 0, main thread (most recent call last) ---" in text
    assert "Cell, line 8, in <module>\n    dist.all_reduce(t)" in text
    assert "in all_reduce" in text  # torch.distributed's own frame, below the cell's
    assert f"Cell, line 6, in <module>\n    {stuck}" in text
    assert took < 6 + 2 + 5, took  # the autopsy's 1 s at most, and the stop ladder's 5 s


def test_an_interrupt_shows_where_every_running_rank_is_and_never_restarts(kernel):
    msg_id, _ = kernel.submit(HUNG.format(timeout="60 --restarts 2", stuck="time.sleep(100)"))
    kernel.wait_for_stream(msg_id, "both ranks in")
    time.sleep(2.0)  # rank 0 reaches its all_reduce (microseconds after the line), however loaded the machine
    kernel.manager.interrupt_kernel()
    ran = kernel.collect(msg_id, time.monotonic())
    assert ran.error["ename"] == "KeyboardInterrupt"
    assert ran.error["traceback"] == ["KeyboardInterrupt"]  # the autopsy above it, and none of taas's own frames
    err = ran.stream("stderr")
    assert not any(ours in err for ours in ("magics.py", "execute.py", "execution.py", "supervisor.py", "selectors.py"))
    assert "where the running ranks were: rank 0 waits in all_reduce (line 8); rank 1 is at line 6 in time.sleep" in err
    assert "Cell, line 6, in <module>" in err
    assert "restarting" not in err  # an interrupt is the person's: it stops everything
