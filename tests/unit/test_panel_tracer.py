"""debugger/tracer.py, a rank's half of JupyterLab's debugger panel, over a real authenticated channel
(tests/unit/rankside.py) and the rank's real inbox: what the kernel-level tests (tests/kernel/test_panel.py) cannot
time, a pause that reaches the rank before its cell's tracer exists (JupyterLab's pause button, pressed as the cell
is sent). It stops at the cell's first line, as a pause; it raised ``NotImplementedError`` there once (bdb's
temporary breakpoint, whose clearing bdb leaves to a subclass), and stopped once in Python's own library (a weakref
callback the garbage collector ran on the cell's thread before the cell's first line, in CI). Steps and pauses stop
only in the person's code, as ipykernel's debugger (debugpy's justMyCode) does."""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
import time
import weakref
from typing import Any, Iterator

import pytest

from taas_magic.debugger import tracer
from taas_magic.debugger.ranklink import PanelCommand, PanelNow
from taas_magic.debugger.tracer import PanelReply, PanelResumed, PanelStopped
from taas_magic.rank import execute
from taas_magic.rank.inbox import Inbox
from taas_magic.runspec import PanelPlan
from tests.unit.rankside import WAIT, KernelEnd, connect_here

CELL_FILE = "<taas In[7]>"
PLAN = PanelPlan(path="/tmp/ipykernel_1/1234.py")  # the panel's name for the cell; no breakpoint anywhere
SOURCE = "a = 1\nb = a + 1\n"


class _Collected:
    pass


def _run_cell(inbox: Inbox, namespace: dict, failed: list[BaseException], plan: PanelPlan, source: str) -> None:
    """As rank/main.py runs a cell: its lines registered, the tracer made, started, the cell's code, finished."""
    execute.register_source(CELL_FILE, source)
    cell = tracer.install(inbox, plan, CELL_FILE)
    try:
        assert cell is not None
        cell.start()
        gone = weakref.WeakSet([_Collected()])  # its callback runs here, in _weakrefset.py: Python's library
        assert not gone
        exec(compile(source, CELL_FILE, "exec"), namespace)  # noqa: S102 - the cell's code, as a rank runs it
        cell.finish()
    except BaseException as exc:  # noqa: BLE001 - the test says what the cell raised
        failed.append(exc)


def _cell_on_a_thread(inbox: Inbox, plan: PanelPlan = PLAN,
                      source: str = SOURCE) -> tuple[threading.Thread, dict, list[BaseException]]:
    namespace: dict = {"__name__": "__main__"}
    failed: list[BaseException] = []
    thread = threading.Thread(target=_run_cell, args=(inbox, namespace, failed, plan, source), name="test-cell",
                              daemon=True)
    thread.start()
    return thread, namespace, failed


@contextlib.contextmanager
def _rank_and_kernel() -> Iterator[tuple[Any, Inbox]]:
    """The kernel's end of a real channel (``rank``: what the rank sends, and sending to it) and the rank's inbox;
    no tracer left afterwards for other tests."""
    kernel = KernelEnd()
    channel, rank = connect_here(kernel)
    inbox = Inbox(channel, {PanelNow: tracer.now})
    try:
        yield rank, inbox
    finally:
        tracer.install(inbox, None, CELL_FILE)
        rank.close()
        channel.close()
        kernel.close()


def _said(rank: Any, seq: int, command: str, stepping: bool) -> None:
    """``command`` sent to the stopped rank: its reply, then its resuming."""
    rank.send(PanelCommand(seq, command, {"threadId": 1}))
    assert rank.receive() == PanelReply(seq, {"allThreadsContinued": False})
    assert rank.receive() == PanelResumed(stepping=stepping)


def test_a_pause_that_comes_before_the_cells_tracer_stops_at_its_first_line_then_the_next_cell_runs_free():
    with _rank_and_kernel() as (rank, inbox):
        rank.send(PanelNow(pause=True))  # no cell runs yet: the reader keeps the pause for the next tracer
        deadline = time.monotonic() + WAIT
        while not tracer._pause_asked and time.monotonic() < deadline:
            time.sleep(0.01)
        thread, namespace, failed = _cell_on_a_thread(inbox)
        assert rank.receive() == PanelStopped("pause", 1)
        _said(rank, 1, "continue", stepping=False)
        thread.join(WAIT)
        assert not failed and namespace["b"] == 2, failed

        thread, namespace, failed = _cell_on_a_thread(inbox)  # the pause was the last cell's: this one runs through
        thread.join(WAIT)
        assert not failed and namespace["b"] == 2, failed
        assert not rank._arrived


DEEPCOPIED = """import copy
class Kept:
    def __deepcopy__(self, memo):
        inside = 1
        return self

kept = copy.deepcopy(Kept())
after = 2
"""


@pytest.mark.parametrize("placed", ["cell", "library"])
def test_steps_stop_in_the_persons_code_and_in_a_library_file_the_person_placed_a_breakpoint_in(placed):
    """From a breakpoint in the cell's ``__deepcopy__``, a step out returns through copy.py to the cell's next line;
    from one the person placed in copy.py itself, a step stays in copy.py."""
    lines, first = inspect.getsourcelines(copy.deepcopy)
    in_copy = first + next(index for index, text in enumerate(lines) if text.strip() == "if memo is None:")
    where, line, command, then = {"cell": (PLAN.path, 4, "stepOut", 8), "library": (copy.__file__, in_copy, "next",
                                                                                     in_copy + 1)}[placed]
    with _rank_and_kernel() as (rank, inbox):
        thread, namespace, failed = _cell_on_a_thread(inbox, PanelPlan(path=PLAN.path, breakpoints=((where, (line,)),)),
                                                      DEEPCOPIED)
        assert rank.receive() == PanelStopped("breakpoint", line)
        _said(rank, 1, command, stepping=True)
        assert rank.receive() == PanelStopped("step", then)
        _said(rank, 2, "continue", stepping=False)
        thread.join(WAIT)
        assert not failed and namespace["after"] == 2, failed


def test_the_library_is_pythons_the_installed_packages_and_generated_code_and_the_cells_are_not():
    assert tracer.is_library(copy.__file__) and tracer.is_library(weakref.__file__)
    assert tracer.is_library(threading.__file__) and tracer.is_library("<frozen importlib._bootstrap>")
    assert tracer.is_library(pytest.__file__)
    assert tracer.is_library("<string>") and tracer.is_library("<eval_with_key>.3")  # a dataclass's, torch.fx's code
    assert not tracer.is_library(CELL_FILE) and not tracer.is_library(__file__)
    assert not tracer.is_library("<ipython-input-3-0123456789ab>")
