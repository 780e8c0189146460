"""The rank's IPython shell (taas_magic/rank/shell.py), in a real child process whose rich output goes to the
kernel over a real authenticated channel (tests/unit/rankside.py): built only on first use (``get_ipython()`` in the
cell, or IPython's import), over the cell's own module; ``display`` and ``clear_output`` reach the kernel as numbered
``Display`` and ``ClearOutput`` frames, each followed by its marker on fd 1, after the text printed before it; a rank
that does not forward (not rank 0, without ``--output all``) sends nothing and marks nothing; ``!cmd`` runs; no
history file is written; it does not look interactive (no ``sys.ps1``, which would make Lightning refuse ``ddp``);
the names it put in the namespace are known; and after the cell IPython's post-execute events fire.

An InteractiveShell is a process-wide singleton that takes over ``sys.displayhook``: only the child builds one."""

from __future__ import annotations

import json
import os

import pytest

from taas_magic.output.relay import ClearOutput, Display, display_marker
from taas_magic.rank import shell  # noqa: F401 - the module under test, run by the child below
from tests.unit import rankside
from tests.unit.rankside import KernelEnd

RANK = r'''
import json, os, sys, types
from taas_magic import protocol, wire
from taas_magic.rank import shell

handshake = wire.Handshake.parse(sys.stdin.readline())
channel = protocol.PeerChannel(wire.BlockingChannel.connect(handshake.host, handshake.port, handshake.key, 0))
out = {"before": {"hidden": sorted(shell.hidden_names()), "shell": shell._state["shell"] is not None}}
shell.after_cell()  # no shell yet: nothing to do, nothing built
out["before"]["built_by_after_cell"] = shell._state["shell"] is not None
module = types.ModuleType("__main__")
module.__dict__["__builtins__"] = __builtins__
sys.modules["__main__"] = module
shell.configure(module, channel.send)
module.__dict__["get_ipython"] = shell.get_ipython
exec(compile("""
print("before", end="")
ip = get_ipython()
from IPython.display import HTML, clear_output, display
display("hello")
print("between")
display(HTML("<b>bold</b>"), metadata={"isolated": True})
clear_output(wait=True)
ip.system("echo from-the-shell")
x = 1
""", "<taas In[1]>", "exec"), module.__dict__)
sys.stdout.flush()
ip = module.ip
events = []
ip.events.register("post_execute", lambda: events.append("post_execute"))
ip.events.register("post_run_cell", lambda result: events.append(("post_run_cell", result)))
shell.after_cell()
import IPython
shell.on_ipython_import(IPython)
out.update(same=shell.get_ipython() is ip is shell.get_shell(), user_ns=ip.user_ns is module.__dict__,
           ps=[name for name in ("ps1", "ps2", "ps3") if hasattr(sys, name)], hidden=sorted(shell.hidden_names()),
           events=events, history=ip.history_manager.enabled,
           files=sorted(os.path.join(folder, name) for folder, _, names in os.walk(os.environ["IPYTHONDIR"]) for name in names))
shell.configure(module, None)  # a rank that does not forward: rank 1 without --output all
exec(compile("display('dropped')\nprint('after')", "<taas In[1]>", "exec"), module.__dict__)
sys.stdout.flush()
channel.close()
print(json.dumps(out), flush=True)
'''


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """(the frames the kernel received, the child's stdout up to its report, its report, its IPython folder)."""
    ipython_dir = tmp_path_factory.mktemp("ipython")
    kernel = KernelEnd()
    child = rankside.start(RANK, kernel.handshake(), env={**os.environ, "IPYTHONDIR": str(ipython_dir)})
    try:
        rank = kernel.accept()
        frames = []
        while True:
            try:
                frames.append(rank.receive())
            except ConnectionError:
                break  # the rank closed its channel: every frame is in
        rank.close()
        code, out, err = rankside.finish(child)
    finally:
        rankside.end(child)
        kernel.close()
    assert code == 0, out + err
    text, _, report = out.rstrip("\n").rpartition("\n")
    return frames, text + "\n", json.loads(report), str(ipython_dir)


def test_displays_reach_the_kernel_numbered_in_order(ran):
    frames, _, _, _ = ran
    assert frames == [
        Display({"text/plain": "'hello'"}, {}, {}, False, 0),
        Display({"text/html": "<b>bold</b>", "text/plain": "<IPython.core.display.HTML object>"}, {"isolated": True}, {},
                False, 1),
        ClearOutput(True, 2),
    ]


def test_each_displays_marker_follows_the_text_printed_before_it_and_a_shell_command_runs(ran):
    _, text, _, _ = ran
    marks = [display_marker(number).decode() for number in range(3)]
    assert text == f"before{marks[0]}between\n{marks[1]}{marks[2]}from-the-shell\r\nafter\n"  # !cmd through a pty


def test_a_rank_that_does_not_forward_sends_nothing_and_marks_nothing(ran):
    frames, text, _, _ = ran
    assert len(frames) == 3 and "dropped" not in text and display_marker(3).decode() not in text


def test_the_shell_is_built_once_on_first_use_over_the_cells_module(ran):
    _, _, report, _ = ran
    assert report["before"] == {"hidden": [], "shell": False, "built_by_after_cell": False}
    assert report["same"] is True and report["user_ns"] is True


def test_the_shell_does_not_look_interactive(ran):
    _, _, report, _ = ran
    assert report["ps"] == []


def test_no_history_is_kept(ran):
    _, _, report, ipython_dir = ran
    assert report["history"] is False
    assert not [path for path in report["files"] if "history" in os.path.basename(path)]


def test_the_names_the_shell_put_in_the_namespace_are_known_and_the_cells_are_not_among_them(ran):
    _, _, report, _ = ran
    hidden = set(report["hidden"])
    assert {"In", "Out", "_ih", "_oh", "exit", "quit"} <= hidden
    assert not {"x", "ip", "HTML", "display"} & hidden


def test_after_the_cell_ipythons_post_execute_events_fire_in_order(ran):
    _, _, report, _ = ran
    assert report["events"] == ["post_execute", ["post_run_cell", None]]
