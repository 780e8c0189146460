"""A run that outlives its cell, over a real kernel: --detach, %taas runs/attach/wait/stop, the run log.

The tests' client is a front end without widgets, so a detached run's view here is the text
display updated in place, and ``attach`` shows the log as the cell's own output.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path

import psutil
import pytest

from taas_magic.output.budget import log_dir
from tests.kernel_client import Kernel, describe, left_after, wait_until_gone

TICKS = ("#pragma taas --device cpu --gpus 2 --detach\n"
         "import time\n"
         "for i in range({n}):\n"
         "    print('tick', i, flush=True)\n"
         "    time.sleep({pause})\n"
         "answer = 6 * 7\n"
         "answer\n")


def _run_id(ran) -> str:
    match = re.search(r"run ([0-9a-f]{12})", json.dumps([m.content for m in ran.messages]))
    assert match, ran.messages
    return match.group(1)


def _runs(kernel: Kernel) -> str:
    return kernel.execute("%taas runs").stream()


@pytest.fixture
def go_on(tmp_path):
    """The file that lets a run held by :func:`_held_until` end; made when the test ends at the latest."""
    flag = tmp_path / "go-on"
    yield flag
    flag.touch()


def _held_until(flag: Path, cell: str) -> str:
    """``cell`` (TICKS) with its run held after its ticks until ``flag`` exists: the test says when it may end,
    so that what the test sees while it runs does not depend on how fast this machine is."""
    return cell.replace("answer = 6 * 7\n", f"import os\nwhile not os.path.exists({str(flag)!r}):\n    time.sleep(0.05)\n"
                                             "answer = 6 * 7\n")


def _ranks_of(kernel: Kernel) -> list[psutil.Process]:
    """The processes running a cell now (a rank is started fresh, or is a spare renamed when taken)."""
    return [p for p in kernel.children() if p.name() != "taas-watchdog"]


@pytest.mark.minimums
def test_a_detached_run_returns_at_once_and_the_notebook_goes_on(kernel, go_on):
    ran = kernel.execute(_held_until(go_on, TICKS.format(n=30, pause=0.1)).replace("answer", "detached_answer"))
    assert ran.reply["status"] == "ok", ran.error_text()
    # the cell returned with the view while the run goes on (it waits for go_on): the listing below says so;
    # here, that it returned at once (in 0.02 s here beside a CPU burner; the rest is a loaded machine's slack)
    assert ran.reply_at < 10, ran.reply_at
    run_id = _run_id(ran)
    assert any(m.type == "display_data" and m.content["transient"].get("display_id") == f"taas-view-{run_id}"
               for m in ran.messages)
    other = kernel.execute("print('the notebook is usable', 1 + 1)")
    assert other.stream() == "the notebook is usable 2\n" and other.reply_at < 10  # not blocked by the run
    listed = _runs(kernel)
    assert re.search(rf"{run_id}\s+running \(detached\)\s+2\s+\d\d:\d\d:\d\d", listed), listed
    assert kernel.execute("'detached_answer' in dir()").result["text/plain"] == "False"  # nothing bound behind our back
    go_on.touch()
    waited = kernel.execute(f"%taas wait {run_id[:6]}")
    assert waited.reply["status"] == "ok", waited.error_text()
    assert waited.result["text/plain"] == "42"  # the final value, as a foreground cell returns it
    assert kernel.execute("detached_answer").result["text/plain"] == "42"  # and rank 0's names, bound by the wait
    assert re.search(rf"{run_id}\s+ok\s+2\s+\S+\s+tick 29", _runs(kernel)), _runs(kernel)
    again = kernel.execute(f"%taas wait {run_id}")
    assert "already taken" in again.reply["evalue"]


def test_attach_replays_what_the_run_printed_before_it_was_called_then_follows_it(kernel):
    ran = kernel.execute(TICKS.format(n=40, pause=0.05))
    run_id = _run_id(ran)
    time.sleep(1.5)  # lines printed before anyone attaches
    attached = kernel.execute(f"%taas attach {run_id}")
    text = attached.stream("stdout")
    ticks = [int(n) for n in re.findall(r"^tick (\d+)$", text, flags=re.MULTILINE)]
    assert ticks == list(range(40)), text  # the backlog, then the live tail until the run ended, nothing missing
    assert text.startswith("taas: 2 rank(s)")  # from the first entry: the header
    assert kernel.execute("%taas wait").result["text/plain"] == "42"


@pytest.mark.minimums
def test_a_failing_detached_run_raises_its_error_at_wait(kernel):
    ran = kernel.execute("#pragma taas --device cpu --gpus 2 --detach\nimport os, time\ntime.sleep(0.5)\n"
                         "if os.environ['RANK'] == '1':\n    raise ValueError('rank 1 fails later')\n")
    assert ran.reply["status"] == "ok"
    waited = kernel.execute("%taas wait")
    assert waited.reply["status"] == "error"
    assert "rank 1 on localhost raised ValueError: rank 1 fails later" in waited.error_text()
    assert re.search(rf"{_run_id(ran)}\s+failed", _runs(kernel))


def test_stop_stops_a_detached_run_with_the_autopsy_and_leaves_nothing(kernel):
    ran = kernel.execute(TICKS.format(n=1000, pause=0.1))
    run_id = _run_id(ran)
    deadline = time.monotonic() + 120
    while len(_ranks_of(kernel)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = _ranks_of(kernel)
    stopped = kernel.execute(f"%taas stop {run_id}")
    text = stopped.stream()
    assert f"taas: run {run_id} stopped" in text and "rank 0" in text, text  # where its ranks were
    assert not wait_until_gone(ranks, 60)
    waited = kernel.execute(f"%taas wait {run_id}")
    assert waited.error["ename"] == "KeyboardInterrupt"
    assert re.search(rf"{run_id}\s+stopped", _runs(kernel))


@pytest.mark.minimums
def test_an_interrupt_of_the_kernel_does_not_stop_a_detached_run(kernel, go_on):
    ran = kernel.execute(_held_until(go_on, TICKS.format(n=30, pause=0.1)))
    msg_id, started = kernel.submit("import time\nprint('sleeping', flush=True)\ntime.sleep(30)")
    kernel.wait_for_stream(msg_id, "sleeping")  # the interrupt reaches this cell, not an idle kernel
    kernel.manager.interrupt_kernel()
    interrupted = kernel.collect(msg_id, started)
    assert interrupted.error["ename"] == "KeyboardInterrupt"
    assert "running (detached)" in _runs(kernel)
    go_on.touch()
    waited = kernel.execute(f"%taas wait {_run_id(ran)}")
    assert waited.result["text/plain"] == "42"


def test_the_run_log_is_on_disk_owner_only_every_entry_numbered_in_order(kernel):
    ran = kernel.execute(TICKS.format(n=5, pause=0.01))
    kernel.execute("%taas wait")
    path = os.path.join(log_dir(), f"{_run_id(ran)}.run.jsonl")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    entries = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert [entry["seq"] for entry in entries] == list(range(len(entries)))
    assert entries[0]["kind"] == "header" and entries[-1] == {**entries[-1], "kind": "end", "text": "ok"}
    printed = "".join(entry["text"] for entry in entries if entry["kind"] == "out")
    assert printed == "".join(f"tick {i}\n" for i in range(5))


def test_shutting_the_kernel_down_stops_a_detached_run_and_leaves_nothing(new_kernel):
    lone = new_kernel()
    lone.execute(TICKS.format(n=1000, pause=0.1))
    deadline = time.monotonic() + 120
    while len(_ranks_of(lone)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    started = lone.children()
    assert len(_ranks_of(lone)) == 2
    lone.client.shutdown()  # a graceful shutdown request, as the Kernel menu sends
    lone.manager.finish_shutdown(waittime=30)
    alive = wait_until_gone(started, 60)
    assert not alive, describe(alive)


def test_a_second_detached_run_goes_on_beside_the_first_and_each_binds_its_own_names(kernel):
    first = kernel.execute(TICKS.format(n=20, pause=0.05).replace("answer = 6 * 7\nanswer\n", "first = 1\n41 + first\n"))
    second = kernel.execute(TICKS.format(n=5, pause=0.05).replace("answer = 6 * 7\nanswer\n", "second = 2\n"))
    assert second.reply["status"] == "ok", second.error_text()
    ids = _run_id(first), _run_id(second)
    kernel.execute(f"%taas wait {ids[1]}")
    assert kernel.execute("(second, 'first' in dir())").result["text/plain"] == "(2, False)"
    from_code = kernel.execute(f"import taas\nvalue = taas.wait({ids[0]!r})\n(value, first)")
    assert from_code.result["text/plain"] == "(42, 1)", from_code.error_text()
    assert not left_after(kernel, 30)
