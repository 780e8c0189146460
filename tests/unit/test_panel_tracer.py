"""debugger/tracer.py, a rank's half of JupyterLab's debugger panel, over a real authenticated channel
(tests/unit/rankside.py) and the rank's real inbox: what the kernel-level tests (tests/kernel/test_panel.py) cannot
time, a pause that reaches the rank before its cell's tracer exists (JupyterLab's pause button, pressed as the cell
is sent). It stops at the cell's first line, as a pause; it raised ``NotImplementedError`` there once (bdb's
temporary breakpoint, whose clearing bdb leaves to a subclass)."""

from __future__ import annotations

import threading
import time

from taas_magic.debugger import tracer
from taas_magic.debugger.ranklink import PanelCommand, PanelNow
from taas_magic.debugger.tracer import PanelReply, PanelResumed, PanelStopped
from taas_magic.rank.inbox import Inbox
from taas_magic.runspec import PanelPlan
from tests.unit.rankside import WAIT, KernelEnd, connect_here

CELL_FILE = "<taas In[7]>"
PLAN = PanelPlan(path="/tmp/ipykernel_1/1234.py")  # the panel's name for the cell; no breakpoint anywhere
SOURCE = "a = 1\nb = a + 1\n"


def _run_cell(inbox: Inbox, namespace: dict, failed: list[BaseException]) -> None:
    """As rank/main.py runs a cell: the tracer made, started, the cell's code, finished."""
    cell = tracer.install(inbox, PLAN, CELL_FILE)
    try:
        assert cell is not None
        cell.start()
        exec(compile(SOURCE, CELL_FILE, "exec"), namespace)  # noqa: S102 - the cell's code, as a rank runs it
        cell.finish()
    except BaseException as exc:  # noqa: BLE001 - the test says what the cell raised
        failed.append(exc)


def _cell_on_a_thread(inbox: Inbox) -> tuple[threading.Thread, dict, list[BaseException]]:
    namespace: dict = {"__name__": "__main__"}
    failed: list[BaseException] = []
    thread = threading.Thread(target=_run_cell, args=(inbox, namespace, failed), name="test-cell", daemon=True)
    thread.start()
    return thread, namespace, failed


def test_a_pause_that_comes_before_the_cells_tracer_stops_at_its_first_line_then_the_next_cell_runs_free():
    kernel = KernelEnd()
    channel, rank = connect_here(kernel)
    inbox = Inbox(channel, {PanelNow: tracer.now})
    try:
        rank.send(PanelNow(pause=True))  # no cell runs yet: the reader keeps the pause for the next tracer
        deadline = time.monotonic() + WAIT
        while not tracer._pause_asked and time.monotonic() < deadline:
            time.sleep(0.01)
        thread, namespace, failed = _cell_on_a_thread(inbox)
        assert rank.receive() == PanelStopped("pause", 1)
        rank.send(PanelCommand(1, "continue", {"threadId": 1}))
        assert rank.receive() == PanelReply(1, {"allThreadsContinued": False})
        assert rank.receive() == PanelResumed(stepping=False)
        thread.join(WAIT)
        assert not failed and namespace["b"] == 2, failed

        thread, namespace, failed = _cell_on_a_thread(inbox)  # the pause was the last cell's: this one runs through
        thread.join(WAIT)
        assert not failed and namespace["b"] == 2, failed
        assert not rank._arrived
    finally:
        tracer.install(inbox, None, CELL_FILE)  # no tracer left for other tests
        rank.close()
        channel.close()
        kernel.close()
