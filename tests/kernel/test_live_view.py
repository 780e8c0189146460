"""The live widget's kernel half, over a real kernel whose client speaks the widget protocol.

The client here does what a page's widget manager does (tests/browser does it in a real
JupyterLab): it opens the ``jupyter.widget.control`` comm when it connects, reads the run's
widget model from the ``comm_open`` the kernel sends, and asks the model for the entries after
a sequence number, while the cell still runs. What must hold: the run is shown as the widget
(not as stream output), the kernel answers the backlog request and a ``kernel_info_request``
in the middle of the run (the cell waits as a coroutine), and the entries it sends are
numbered without a gap and are the run's output. On an ipykernel older than 7.4, which
answers the page only between cells, the run is still its live widget, the cell says so in
one line, and the page's request is answered when the cell ends.
"""

from __future__ import annotations

import queue
import re
import time

import ipykernel
import pytest
from ipykernel.ipkernel import IPythonKernel

from taas_magic.output.frontend import MID_CELL_IPYKERNEL, answers_mid_cell

pytest.importorskip("anywidget", reason="the live view is an anywidget")

ANSWERS_MID_CELL = answers_mid_cell(IPythonKernel)  # the kernels these tests start run this env's ipykernel

CELL = ("#pragma taas --device cpu --gpus 2\nimport time\nfor i in range(60):\n"
        "    print('tick', i, flush=True)\n    time.sleep(0.05)\n'done'\n")


def _as_a_widget_page(kernel) -> None:
    """Open the widget manager's control comm, as a page does when it connects."""
    message = kernel.client.session.msg("comm_open", {"comm_id": "page-control", "target_name": "jupyter.widget.control",
                                                      "data": {}}, metadata={"version": "1.0.0"})
    kernel.client.shell_channel.send(message)


def _ask(kernel, comm_id: str, content: dict) -> None:
    message = kernel.client.session.msg("comm_msg", {"comm_id": comm_id, "data": {"method": "custom", "content": content}})
    kernel.client.shell_channel.send(message)


@pytest.mark.minimums
@pytest.mark.skipif(not ANSWERS_MID_CELL, reason=f"ipykernel < {MID_CELL_IPYKERNEL}: the test after this one")
def test_a_run_in_a_widget_page_is_its_live_widget_and_answers_the_page_while_it_runs(new_kernel):
    kernel = new_kernel()
    _as_a_widget_page(kernel)
    kernel.execute("1")  # the comm is open before the next cell starts
    msg_id, _ = kernel.submit(CELL)
    comm_id, entries, backlog, info_after, replies = None, {}, None, None, []
    streamed = ""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            msg = kernel.client.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "comm_open" and "run_id" in content["data"].get("state", {}):
            comm_id = content["comm_id"]
        elif kind == "comm_msg" and content["comm_id"] == comm_id and content["data"].get("method") == "custom":
            sent = content["data"]["content"]
            for seq, _stream, text in sent.get("entries", []):
                entries[seq] = text
            if sent.get("backlog"):
                backlog = sent
        elif kind == "stream" and msg["parent_header"].get("msg_id") == msg_id:
            streamed += content["text"]
        elif kind == "status" and msg["parent_header"].get("msg_id") == msg_id and content["execution_state"] == "idle":
            break
        if comm_id and backlog is None and "tick 10\n" in "".join(entries.values()):
            _ask(kernel, comm_id, {"backlog": -1})  # a view made now: everything the kernel keeps
            backlog = {}
            asked = time.monotonic()
            info_id = kernel.client.kernel_info()
        if info_after is None and backlog is not None:
            replies.extend(_shell_replies(kernel))
            if any(reply["parent_header"].get("msg_id") == info_id for reply in replies):
                info_after = time.monotonic() - asked
    assert comm_id is not None, "the run was shown as its widget"
    assert "tick" not in streamed  # not also as stream output
    assert "taas: ipykernel" not in streamed  # this kernel answers mid-cell: nothing to say
    assert backlog, "the backlog request was answered"
    ticks = [int(n) for n in re.findall(r"tick (\d+)", "".join(entries[seq] for seq in sorted(entries)))]
    assert ticks == list(range(60))
    assert sorted(entries) == list(range(len(entries)))  # no sequence number missing
    numbers = [seq for seq, _, _ in backlog["entries"]]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))) and numbers[0] == 0
    assert max(numbers) < max(entries)  # answered while the run went on: later entries came after it
    assert info_after is not None and info_after < 1.0, info_after  # kernel_info answered mid-run
    while not any(reply["parent_header"].get("msg_id") == msg_id for reply in replies):
        replies.extend(_shell_replies(kernel, timeout=1))
    assert next(r for r in replies if r["parent_header"].get("msg_id") == msg_id)["content"]["status"] == "ok"


@pytest.mark.minimums
@pytest.mark.skipif(ANSWERS_MID_CELL, reason=f"ipykernel >= {MID_CELL_IPYKERNEL} answers the page mid-cell")
def test_where_the_kernel_answers_only_between_cells_the_cell_says_so_in_one_line_and_the_view_still_runs(new_kernel):
    kernel = new_kernel()
    _as_a_widget_page(kernel)
    kernel.execute("1")
    msg_id, _ = kernel.submit(CELL)
    comm_id, entries, backlog, asked, idle_at, backlog_at = None, {}, None, False, None, None
    streamed, snapshot = "", {}

    def shown_to_the_end() -> bool:  # the page was answered, and the view's pump (maybe later) showed that end
        end = backlog["entries"][-1][0] if backlog else None
        return end is not None and end in entries and snapshot.get("seq") == end

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not shown_to_the_end():
        try:
            msg = kernel.client.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "comm_open" and "run_id" in content["data"].get("state", {}):
            comm_id = content["comm_id"]
        elif kind == "comm_msg" and content["comm_id"] == comm_id and content["data"].get("method") == "custom":
            sent = content["data"]["content"]
            for seq, _stream, text in sent.get("entries", []):
                entries[seq] = text
            if sent.get("backlog"):
                backlog, backlog_at = sent, time.monotonic()
        elif kind == "comm_msg" and content["comm_id"] == comm_id and content["data"].get("method") == "update":
            snapshot.update(content["data"]["state"])  # the model's state: what a page made now starts from
        elif kind == "stream" and msg["parent_header"].get("msg_id") == msg_id:
            streamed += content["text"]
        elif kind == "status" and msg["parent_header"].get("msg_id") == msg_id and content["execution_state"] == "idle":
            idle_at = time.monotonic()
        if comm_id and not asked and "tick 10\n" in "".join(entries.values()):
            _ask(kernel, comm_id, {"backlog": -1})  # a page reloaded mid-run asks for what it missed
            asked = True
    assert comm_id is not None, "the run was shown as its widget"
    assert backlog is not None, "the page's request was answered"
    end_seq = backlog["entries"][-1][0]
    ticks = [int(n) for n in re.findall(r"tick (\d+)", "".join(entries[seq] for seq in sorted(entries)))]
    assert ticks == list(range(60)), "the widget was fed as the run went"
    note = f"taas: ipykernel {ipykernel.__version__} answers the page only between cells"
    assert streamed.startswith(note) and streamed.count("\n") == 1, streamed  # one line, and no output of the run
    assert f"ipykernel >= {MID_CELL_IPYKERNEL}" in streamed
    assert backlog is not None and idle_at is not None and backlog_at > idle_at, "the page's request was answered after the cell"
    # by then the run had ended: the answer runs without a gap to the run's end, from the first entry the kernel
    # still keeps, what came before named as skipped (once every view showed the end and the run let go, the
    # kernel keeps only that end; the log's file keeps the rest); the model's final snapshot is the whole
    # screen as of that end, which is what a page reloaded now draws before it asks
    assert end_seq == max(entries)
    answered = [seq for seq, _, _ in backlog["entries"]]
    assert answered == list(range(answered[0], end_seq + 1)), answered
    assert backlog.get("skipped", [0, -1]) == [0, answered[0] - 1]
    assert snapshot["seq"] == end_seq
    assert any("tick 59" in line for line in snapshot["lines"]), snapshot["lines"][-3:]


def _shell_replies(kernel, timeout: float = 0.01) -> list[dict]:
    try:
        return [kernel.client.get_shell_msg(timeout=timeout)]
    except queue.Empty:
        return []


def test_a_failing_runs_view_points_at_its_error_and_does_not_repeat_it(new_kernel):
    """The cell's error box shows the traceback once; the live view above it says the run failed and
    where the error is (on a JupyterLab page, and in a notebook saved with its widget state)."""
    kernel = new_kernel()
    _as_a_widget_page(kernel)
    kernel.execute("1")
    msg_id, _ = kernel.submit("#pragma taas --device cpu --gpus 2\nimport os\n"
                              "if os.environ['RANK'] == '1':\n    raise ValueError('rank 1 fails on purpose')\n")
    comm_id, state, error = None, {}, None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            msg = kernel.client.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "comm_open" and "run_id" in content["data"].get("state", {}):
            comm_id = content["comm_id"]
            state.update(content["data"]["state"])
        elif kind == "comm_msg" and content["comm_id"] == comm_id and content["data"].get("method") == "update":
            state.update(content["data"]["state"])
        elif kind == "error" and msg["parent_header"].get("msg_id") == msg_id:
            error = "\n".join(content["traceback"])
        if error is not None and state.get("state") == "failed":  # the view's last update may follow the error
            break
    assert error is not None and "rank 1 fails on purpose" in error  # the cell's error box: the traceback, once
    assert state.get("state") == "failed", state
    assert state["error"] == [f"taas: the run failed; its error is in the cell's output (below this view, or where "
                              f"%taas wait {state['run_id']} ran)"], state["error"]
    assert "fails on purpose" not in "\n".join(state["lines"])  # nor in the view's text
