"""JupyterLab's debugger panel on the ranks, through a real kernel's control channel as the panel speaks it
(tests/panelled.py): two ranks stop at a gutter breakpoint; stepping over, in and out, and pause, per rank, while
the other rank's collective waits past its timeout, a rank's value copied into the notebook; kept ranks cell after
cell; a plain cell keeps debugpy."""

from __future__ import annotations

import time

import pytest

from tests.kernel_client import Kernel
from tests.panelled import (
    breakpoint_in,
    closed,
    opened,
    two_ranks_stop_and_show_their_own_variables,
)

LOCAL = "#pragma taas --device cpu --gpus 2"
STEPS = """#pragma taas --device cpu --gpus 2 --output all
import os, time
from datetime import timedelta
import torch, torch.distributed as dist
def double(x):
    y = x * 2
    return y
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", timeout=timedelta(seconds=2))
value = double(rank)
total = torch.tensor([value])
dist.all_reduce(total)
stop, spun = False, 0
print("spinning", rank, flush=True)
while rank == 1 and not stop:
    time.sleep(0.01)
    spun += 1
print("rank", rank, "total", int(total))
"""
CALL, BODY, RETURN, AFTER = 10, 6, 7, 11  # the lines of STEPS: double(rank), its body, its return, the line after


@pytest.fixture(scope="module")
def kernel():
    """A kernel of this module's own: the panel starts debugpy in it, which stays (the session's shared one is not)."""
    own = Kernel()
    yield own
    own.shutdown()


@pytest.fixture(scope="module")
def panel(kernel):
    """The panel, opened once for this module (ipykernel's debugpy client is started once a kernel)."""
    started = opened(kernel)
    yield started
    closed(started)


def test_two_ranks_stop_at_a_gutter_breakpoint_and_each_shows_its_own_variables(kernel, panel):
    two_ranks_stop_and_show_their_own_variables(kernel, panel, LOCAL)


def test_a_rank_steps_in_over_and_out_and_is_paused_while_the_other_waits_past_its_timeout(kernel, panel):
    path = breakpoint_in(panel, STEPS, CALL)
    panel.events.clear()
    cell = kernel.client.execute(STEPS)
    stops = {panel.event("stopped", cell)["body"]["threadId"]: None for _ in range(2)}
    zero, one = sorted(stops)
    panel.request("setBreakpoints", source={"path": path}, breakpoints=[])
    assert panel.request("continue", threadId=zero)["success"]  # rank 0 goes on to the all-reduce and waits there
    let_go = time.monotonic()
    assert panel.event("stopped", cell)["body"]["threadId"] == one  # rank 1, still stopped, said again: shown now

    def stepped(command: str, line: int) -> dict:
        assert panel.request(command, threadId=one)["success"]
        stop = panel.event("stopped", cell)
        assert stop["body"]["threadId"] == one and stop["body"]["reason"] == "step", stop
        top, values = panel.frame(one)
        assert top["line"] == line and top["source"]["path"] == path, (command, top)
        return values

    assert stepped("stepIn", BODY)["x"] == "1"  # into double(rank), the cell's own function
    assert stepped("next", RETURN)["y"] == "2"
    assert stepped("stepOut", AFTER)["value"] == "2"  # back in the cell, its result bound
    time.sleep(max(0.0, let_go + 3 - time.monotonic()))  # rank 0 has waited in its all-reduce past its 2 s timeout
    assert panel.request("continue", threadId=one)["success"]
    panel.printed("spinning 1", cell)  # past its all-reduce: a pause now lands in the cell's loop, not in torch's code
    # rank 1 spins until told to stop; JupyterLab's pause button, nothing stopped, names debugpy's first thread
    pause = panel.request("pause", threadId=1)
    assert pause["success"], pause
    paused = panel.event("stopped", cell)
    assert paused["body"]["threadId"] == one and paused["body"]["reason"] == "pause", paused
    top, values = panel.frame(one)
    assert values["stop"] == "False" and values["total"] == "tensor([2])", values
    copied = panel.request("copyToGlobals", srcVariableName="spun", dstVariableName="spun_on_rank_1",
                           srcFrameId=top["id"])  # the Variables panel's Copy to Globals
    assert copied["success"], copied
    assert panel.request("evaluate", expression="stop = True", frameId=top["id"], context="repl")["success"]
    assert panel.request("continue", threadId=one)["success"]
    reply = panel.ended(cell)
    assert reply["status"] == "ok", panel.output
    assert "rank 0 total 2" in "".join(panel.output), panel.output
    assert kernel.execute("spun_on_rank_1").result["text/plain"] == values["spun"]  # rank 1's, in the notebook


def test_kept_ranks_stop_cell_after_cell(kernel, panel):
    try:
        two_ranks_stop_and_show_their_own_variables(kernel, panel, LOCAL + " --keep")
        again = LOCAL + " --keep\nmine = mine + 1\nprint('kept', rank, mine)\n"
        path = breakpoint_in(panel, again, 3)
        panel.events.clear()
        cell = kernel.client.execute(again)
        stops = sorted(panel.event("stopped", cell)["body"]["threadId"] for _ in range(2))
        for thread in stops:
            top, values = panel.frame(thread)
            assert top["line"] == 3 and values["mine"] == str(101 + int(values["rank"])), values  # the kept names
        panel.request("setBreakpoints", source={"path": path}, breakpoints=[])
        for thread in stops:
            assert panel.request("continue", threadId=thread)["success"]
        assert panel.ended(cell)["status"] == "ok", panel.output
    finally:
        kernel.execute("%taas release")


def test_a_plain_cell_keeps_ipykernels_own_debugger(kernel, panel):
    code = "a = 1\nb = a + 1\nc = b + 1\n"
    path = panel.request("dumpCell", code=code)["body"]["sourcePath"]
    panel.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": 2}])
    panel.request("configurationDone")
    cell = kernel.client.execute(code)
    thread = panel.event("stopped", cell)["body"]["threadId"]
    assert thread < (1 << 30)  # debugpy's thread: the kernel's own
    panel.request("setBreakpoints", source={"path": path}, breakpoints=[])
    assert panel.request("continue", threadId=thread)["success"]
    assert panel.ended(cell)["status"] == "ok"
