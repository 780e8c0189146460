"""JupyterLab's debugger panel on the ranks, through a real kernel's control channel as the panel speaks it:
``debug_request`` messages, ``debug_event`` on IOPub (debugger/panel.py, debugger/tracer.py)."""

from __future__ import annotations

import queue
import time

import pytest

from tests.kernel_client import Kernel

CELL = """#pragma taas --device cpu --gpus 2
import os
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
mine = 100 + rank
dist.init_process_group("gloo")
total = torch.tensor([mine])
dist.all_reduce(total)
print("rank", rank, "total", int(total))
"""
BREAK_LINE = 6  # dist.init_process_group: both ranks stop there


class CellEnded(AssertionError):
    pass


class Panel:
    """The panel's side: numbered requests on the control channel, events read off IOPub."""

    def __init__(self, kernel: Kernel):
        self.kernel, self.seq, self.events, self.output = kernel, 0, [], []

    def request(self, command: str, **arguments) -> dict:
        self.seq += 1
        client = self.kernel.client
        message = client.session.msg("debug_request", {"type": "request", "seq": self.seq, "command": command,
                                                       "arguments": arguments})
        client.control_channel.send(message)
        while True:
            reply = client.get_control_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == message["header"]["msg_id"]:
                return reply["content"]

    def ended(self, cell: str) -> dict:
        """``cell``'s reply, once it ended (its output in ``output``, the events until then in ``events``)."""
        try:
            self.event("none", cell)
        except CellEnded:
            pass
        while True:
            reply = self.kernel.client.get_shell_msg(timeout=60)
            if reply["parent_header"].get("msg_id") == cell:
                return reply["content"]

    def event(self, name: str, cell: str, deadline: float = 120) -> dict:
        """The next debug event ``name`` while ``cell`` (its message id) runs (those before it kept in ``events``)."""
        until = time.monotonic() + deadline
        while True:
            try:
                message = self.kernel.client.get_iopub_msg(timeout=max(0.1, until - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {name!r} event; events so far: {self.events}") from None
            if message["parent_header"].get("msg_id") == cell and message["msg_type"] in ("stream", "error"):
                self.output.append(message["content"].get("text") or str(message["content"]))
            if message["parent_header"].get("msg_id") == cell and message["msg_type"] == "status" \
                    and message["content"]["execution_state"] == "idle":
                raise CellEnded(f"the cell ended before a {name!r} event: {''.join(self.output)}")
            if message["msg_type"] == "debug_event":
                self.events.append(message["content"])
                if message["content"]["event"] == name:
                    return message["content"]


@pytest.fixture(scope="module")
def panel(kernel):
    """The panel, opened once for this module (ipykernel's debugpy client is started once a kernel)."""
    started = Panel(kernel)
    reply = started.request("initialize", clientID="test", adapterID="", pathFormat="path", linesStartAt1=True,
                            columnsStartAt1=True, supportsVariableType=True, supportsVariablePaging=True,
                            supportsRunInTerminalRequest=True, locale="en")
    assert reply["success"], reply
    assert started.request("attach")["success"]
    yield started
    started.request("disconnect", restart=False, terminateDebuggee=True)


def test_two_ranks_stop_at_a_gutter_breakpoint_and_each_shows_its_own_variables(kernel, panel):
    dumped = panel.request("dumpCell", code=CELL)
    path = dumped["body"]["sourcePath"]
    placed = panel.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": BREAK_LINE}],
                           sourceModified=False)
    assert placed["success"] and placed["body"]["breakpoints"][0]["verified"], placed
    assert panel.request("configurationDone")["success"]
    info = panel.request("debugInfo")["body"]
    assert {"source": path, "breakpoints": [{"line": BREAK_LINE}]} in info["breakpoints"], info

    msg_id = kernel.client.execute(CELL)
    stops = {panel.event("stopped", msg_id)["body"]["threadId"] for _ in range(2)}
    threads = {thread["id"]: thread["name"] for thread in panel.request("threads")["body"]["threads"]}
    assert sorted(threads[stop] for stop in stops) == ["rank 0", "rank 1"], threads
    assert set(panel.request("debugInfo")["body"]["stoppedThreads"]) >= stops  # a reloaded page finds them

    for thread in sorted(stops):
        rank = int(threads[thread].split()[1])
        frames = panel.request("stackTrace", threadId=thread)["body"]["stackFrames"]
        assert frames[0]["line"] == BREAK_LINE and frames[0]["source"]["path"] == path, frames
        scopes = panel.request("scopes", frameId=frames[0]["id"])["body"]["scopes"]
        shown = panel.request("variables", variablesReference=scopes[0]["variablesReference"])["body"]["variables"]
        values = {variable["name"]: variable["value"] for variable in shown}
        assert values["rank"] == str(rank) and values["mine"] == str(100 + rank), values
        evaluated = panel.request("evaluate", expression="mine * 2", frameId=frames[0]["id"], context="repl")
        assert evaluated["body"]["result"] == str(2 * (100 + rank)), evaluated

    for thread in sorted(stops):
        assert panel.request("continue", threadId=thread)["success"]
    reply = panel.ended(msg_id)
    assert reply["status"] == "ok", panel.output
    assert "rank 0 total 201" in "".join(panel.output), panel.output  # the collective after the stops: nothing timed out
    continued = {event["body"]["threadId"] for event in panel.events if event["event"] == "continued"}
    assert continued == stops, panel.events


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
