"""JupyterLab's debugger panel on the ranks, checked the same way on every engine (tests/kernel, tests/ray,
tests/slurm): the panel's own messages through a real kernel's control channel (``debug_request``), its events read
off IOPub (``debug_event``), as JupyterLab sends and reads them (debugger/panel.py, debugger/tracer.py)."""

from __future__ import annotations

import queue
import time

import psutil

CELL = """{head}
import os
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
mine = 100 + rank
dist.init_process_group("gloo")
total = torch.tensor([mine])
dist.all_reduce(total)
print("rank", rank, "total", int(total))
"""
BREAK_LINE = 6  # dist.init_process_group: every rank stops there


class CellEnded(AssertionError):
    pass


class Panel:
    """The panel's side: numbered requests on the control channel, events read off IOPub."""

    def __init__(self, kernel):
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

    def printed(self, text: str, cell: str, deadline: float = 60) -> None:
        """Wait until ``cell``'s output holds ``text`` (the debug events meanwhile kept in ``events``)."""
        until = time.monotonic() + deadline
        while text not in "".join(self.output):
            assert time.monotonic() < until, f"no {text!r} in the cell's output: {''.join(self.output)}"
            try:
                self.event("none", cell, deadline=0.2)
            except AssertionError as ended:
                if isinstance(ended, CellEnded):
                    raise

    def frame(self, thread: int) -> tuple[dict, dict]:
        """A stopped rank's innermost frame, and its first scope's variables by name."""
        frames = self.request("stackTrace", threadId=thread)["body"]["stackFrames"]
        scopes = self.request("scopes", frameId=frames[0]["id"])["body"]["scopes"]
        shown = self.request("variables", variablesReference=scopes[0]["variablesReference"])["body"]["variables"]
        return frames[0], {variable["name"]: variable["value"] for variable in shown}


def _under_debugpy(pid: int) -> list[str]:
    """The command lines of ``pid``'s descendants started under debugpy (pydevd)."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue  # gone meanwhile
        if "pydevd" in line:
            found.append(line)
    return found


def opened(kernel) -> Panel:
    """The panel turned on in ``kernel``, as JupyterLab does (initialize, attach)."""
    panel = Panel(kernel)
    reply = panel.request("initialize", clientID="test", adapterID="", pathFormat="path", linesStartAt1=True,
                          columnsStartAt1=True, supportsVariableType=True, supportsVariablePaging=True,
                          supportsRunInTerminalRequest=True, locale="en")
    assert reply["success"], reply
    assert panel.request("attach")["success"]
    return panel


def closed(panel: Panel) -> None:
    panel.request("disconnect", restart=False, terminateDebuggee=False)


def breakpoint_in(panel: Panel, code: str, line: int) -> str:
    """A gutter breakpoint at ``line`` of ``code`` (dumpCell, setBreakpoints, configurationDone); the cell's file."""
    path = panel.request("dumpCell", code=code)["body"]["sourcePath"]
    placed = panel.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": line}], sourceModified=False)
    assert placed["success"] and placed["body"]["breakpoints"][0]["verified"], placed
    assert panel.request("configurationDone")["success"]
    return path


def two_ranks_stop_and_show_their_own_variables(kernel, panel: Panel, head: str, hosts: bool | None = False) -> None:
    """Both ranks of ``CELL`` under ``head`` stop at its gutter breakpoint, each a thread ``rank K`` (``hosts``: with
    its host, ``rank K (host)``; None: either), with its own variables and evaluate; ``debugInfo`` (what a reloaded
    page reads) has the breakpoint and both stopped threads; continue ends the cell, its collective unharmed."""
    code = CELL.format(head=head)
    path = breakpoint_in(panel, code, BREAK_LINE)
    info = panel.request("debugInfo")["body"]
    assert {"source": path, "breakpoints": [{"line": BREAK_LINE}]} in info["breakpoints"], info
    panel.events.clear()
    cell = kernel.client.execute(code)
    stops = {panel.event("stopped", cell)["body"]["threadId"] for _ in range(2)}
    threads = {thread["id"]: thread["name"] for thread in panel.request("threads")["body"]["threads"]}
    names = sorted(threads[stop] for stop in stops)
    assert [name.split(" (")[0] for name in names] == ["rank 0", "rank 1"], threads
    assert hosts is None or all(("(" in name) == hosts for name in names), names
    assert set(panel.request("debugInfo")["body"]["stoppedThreads"]) >= stops  # a reloaded page finds them
    assert not _under_debugpy(kernel.pid)  # debugpy's subProcess would start every spare and rank under pydevd
    for thread in sorted(stops):
        rank = int(threads[thread].split()[1])
        top, values = panel.frame(thread)
        assert top["line"] == BREAK_LINE and top["source"]["path"] == path, top
        assert values["rank"] == str(rank) and values["mine"] == str(100 + rank), values
        evaluated = panel.request("evaluate", expression="mine * 2", frameId=top["id"], context="repl")
        assert evaluated["body"]["result"] == str(2 * (100 + rank)), evaluated
    first, second = sorted(stops)
    assert panel.request("continue", threadId=first)["success"]
    # JupyterLab shows one thread, the last said stopped: the rank still stopped is said again, after the continue
    again = panel.event("stopped", cell)
    assert again["body"]["threadId"] == second, panel.events
    assert [event["event"] for event in panel.events[-2:]] == ["continued", "stopped"], panel.events
    assert panel.request("continue", threadId=second)["success"]
    reply = panel.ended(cell)
    assert reply["status"] == "ok", panel.output
    assert "rank 0 total 201" in "".join(panel.output), panel.output  # the collective after the stops, not timed out
    continued = {event["body"]["threadId"] for event in panel.events if event["event"] == "continued"}
    assert continued == stops, panel.events
    panel.request("setBreakpoints", source={"path": path}, breakpoints=[])


def ranks_on_two_hosts_stop_in_the_panel(kernel) -> None:
    """A cluster engine (Ray, Slurm): the panel opened, two ranks on two hosts stopped and shown over their own
    channels (no port per rank host), continued to the end; the panel closed again (the kernel is the module's)."""
    panel = opened(kernel)
    try:
        two_ranks_stop_and_show_their_own_variables(kernel, panel, "#pragma taas --gpus 2 --per-host 1", hosts=None)
    finally:
        closed(panel)
