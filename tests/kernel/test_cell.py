"""A taas cell against a real kernel: streaming, namespace, environment, syntax, output."""

import json
import os
import re

import pytest

ALL_REDUCE = """\
#!g2.8
#pragma taas --device cpu --gpus 2
import os, time, torch
import torch.distributed as dist
dist.init_process_group(backend="nccl", init_method="env://")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(f"rank {dist.get_rank()} total {total.item()}", flush=True)
while not os.path.exists(GO_ON):  # the test makes it once rank 0's line has reached it
    time.sleep(0.01)
doubled = scale(total.item())
dist.destroy_process_group()
doubled + offset
"""


@pytest.mark.minimums
def test_rank0_streams_live_and_names_come_back(kernel, tmp_path):
    go_on = tmp_path / "go-on"
    kernel.execute(f"offset = 100\ndef scale(v):\n    return v * 2\nGO_ON = {str(go_on)!r}")
    msg_id, started = kernel.submit(ALL_REDUCE)
    try:  # streamed live: the ranks wait until the line has come, however long this machine takes to bring it
        before = kernel.wait_for_stream(msg_id, "rank 0 total")
    finally:
        go_on.touch()
    ran = kernel.collect(msg_id, started)
    assert ran.reply["status"] == "ok", ran.error_text()
    out = "".join(m.content["text"] for m in before if m.type == "stream" and m.content["name"] == "stdout")
    out += ran.stream("stdout")
    assert "config g2.8" in out.splitlines()[0] and "2 rank(s)" in out
    assert "nccl is served by gloo" in out
    assert "rank 0 total 3.0" in out and "rank 1" not in out
    assert ran.result["text/plain"] == "106.0"
    after = kernel.execute("print(doubled, float(total), type(total).__name__)")
    assert after.stream("stdout") == "6.0 3.0 Tensor\n"


def test_rank_environment_matches_torchrun(kernel):
    ran = kernel.execute("import sys\nkernel_path = list(sys.path)")
    assert ran.reply["status"] == "ok"
    ran = kernel.execute(
        """#pragma taas --device cpu --gpus 2 --output all
import os, sys, json
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME"]
info = {k: os.environ.get(k) for k in keys}
info["cwd"] = os.getcwd()
info["ps1"] = hasattr(sys, "ps1")
info["path_ok"] = sys.path == kernel_path
info["stdin_empty"] = sys.stdin.read() == ""
print("ENV" + json.dumps(info))
"""
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    lines = [line for line in ran.stream("stdout").splitlines() if "ENV{" in line]
    assert sorted(line.split("]")[0] for line in lines) == ["[rank 0", "[rank 1"]
    infos = {int(info["RANK"]): info for info in (json.loads(line.split("ENV", 1)[1]) for line in lines)}
    cwd = kernel.execute("import os; print(os.getcwd())").stream("stdout").strip()
    for rank, info in infos.items():
        assert info["LOCAL_RANK"] == str(rank) and info["WORLD_SIZE"] == "2" and info["LOCAL_WORLD_SIZE"] == "2"
        assert info["GROUP_RANK"] == "0" and info["MASTER_ADDR"] == "127.0.0.1"
        assert info["GLOO_SOCKET_IFNAME"] == "lo"
        assert info["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))
        assert info["cwd"] == cwd and info["path_ok"] and not info["ps1"] and info["stdin_empty"]
    assert infos[0]["MASTER_PORT"] == infos[1]["MASTER_PORT"]
    assert infos[0]["TORCHELASTIC_RUN_ID"] == infos[1]["TORCHELASTIC_RUN_ID"]


def test_the_run_key_is_not_in_the_rank_environment(kernel):
    ran = kernel.execute(
        """#pragma taas --device cpu --gpus 1
import os
print("KEYISH", [k for k, v in os.environ.items() if len(v) == 64 and set(v) <= set("0123456789abcdef")])
"""
    )
    assert "KEYISH []" in ran.stream("stdout"), ran.stream()


@pytest.mark.minimums
def test_ipython_syntax_runs_in_the_ranks(kernel):
    ran = kernel.execute(
        """#pragma taas --device cpu --gpus 2
word = "hello"
!echo shell-says-$word
%time squares = [i * i for i in range(5)]
files = !echo captured
"""
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    assert "shell-says-hello" in ran.stream("stdout")
    assert "Wall time" in ran.stream()
    check = kernel.execute("print(squares, files)")
    assert check.stream("stdout") == "[0, 1, 4, 9, 16] ['captured']\n"


def test_rich_output_and_matplotlib_figures(kernel):
    pytest.importorskip("matplotlib")
    ran = kernel.execute(
        """#pragma taas --device cpu --gpus 2
from IPython.display import display, HTML
print("before")
display(HTML("<b>from rank 0</b>"))
print("after")
import matplotlib.pyplot as plt  # the backend is the kernel's (ipykernel sets MPLBACKEND), not forced
plt.plot([1, 2, 3])
plt.show()
"""
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    # the cell's own displays (taas's health line and chart, with their taas-* display ids, sit above them)
    messages = [m for m in ran.messages
                if not m.content.get("transient", {}).get("display_id", "").startswith("taas-")]
    kinds = [(m.type, m.content.get("text") or sorted(m.content.get("data", {}))) for m in messages
             if m.type in ("stream", "display_data")]
    displays = [m for m in messages if m.type == "display_data"]
    assert len(displays) == 2, kinds
    assert displays[0].content["data"]["text/html"] == "<b>from rank 0</b>"
    assert "image/png" in displays[1].content["data"]
    order = [m.type if m.type != "stream" else m.content["text"].strip() for m in messages
             if m.type in ("stream", "display_data")]
    assert order.index("before") < order.index("display_data") < order.index("after")


INTERLEAVED = """#pragma taas --device cpu --gpus 2 OPTIONS
from IPython.display import display, HTML
for i in range(5):
    print("before", i, flush=True)
    display(HTML(f"<b>{i}</b>"))
    print("after", i, flush=True)
"""


@pytest.mark.parametrize("options", ["", "--keep"])
def test_text_and_displays_reach_the_cell_in_the_order_rank_0_made_them(kernel, options):
    """The cell's view sends text and displays straight to ipykernel's IOPub thread (output/frontend.py's
    cell_output): each queued there in order, none overtaking another, on fresh and on kept ranks."""
    try:
        ran = kernel.execute(INTERLEAVED.replace("OPTIONS", options), timeout=120)
        assert ran.reply["status"] == "ok", ran.error_text()
    finally:
        if options:
            kernel.execute("%taas release")
    shown = []
    for message in ran.messages:
        if message.content.get("transient", {}).get("display_id", "").startswith("taas-"):
            continue  # taas's own health line and chart, above the output
        if message.type == "stream":
            shown += [line for line in message.content["text"].splitlines() if line.startswith(("before", "after"))]
        elif message.type == "display_data":
            shown.append(message.content["data"]["text/html"])
    assert shown == [each for i in range(5) for each in (f"before {i}", f"<b>{i}</b>", f"after {i}")], shown


def test_final_expression_and_names_that_cannot_come_back(kernel):
    ran = kernel.execute(
        """#pragma taas --device cpu --gpus 1
import threading
guard = threading.Lock()
answer = 41
answer + 1
"""
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    assert ran.result["text/plain"] == "42"
    assert "could not come back" in ran.stream("stderr") and "guard" in ran.stream("stderr")
    assert kernel.execute("print(answer)").stream("stdout") == "41\n"


@pytest.mark.minimums
def test_trailing_semicolon_suppresses_the_result(kernel):
    ran = kernel.execute("#pragma taas --device cpu --gpus 1\nvalue = 3\nvalue * 2;")
    assert ran.reply["status"] == "ok" and ran.result is None


def test_in_place_changes_to_shipped_values_come_back(kernel):
    kernel.execute("history = []\nunchanged = {'a': 1}\nunchanged_id = id(unchanged)")
    ran = kernel.execute("#pragma taas --device cpu --gpus 1\nhistory.append('trained')\nunchanged['a']")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert ran.result["text/plain"] == "1"
    after = kernel.execute("print(history, unchanged, id(unchanged) == unchanged_id)").stream("stdout")
    assert after == "['trained'] {'a': 1} True\n"  # the untouched dict is still the notebook's own object


def test_lightning_style_no_ps1_and_get_worker_info(kernel):
    ran = kernel.execute(
        """#pragma taas --device cpu --gpus 2 --output all
import sys, taas
info = taas.get_worker_info()
print("INFO", info.id, info.num_workers, hasattr(sys, "ps1"), sys.flags.interactive)
"""
    )
    out = ran.stream("stdout")
    assert "[rank 0] INFO 0 2 False 0" in out and "[rank 1] INFO 1 2 False 0" in out
    assert kernel.execute("import taas; print(taas.get_worker_info())").stream("stdout") == "None\n"


def test_percent_percent_taas_form(kernel):
    ran = kernel.execute("%%taas --device cpu --gpus 2\nimport os\n"
                         "print('rank', os.environ['RANK'])\nint(os.environ['WORLD_SIZE'])")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert ran.stream("stdout").endswith("rank 0\n")
    assert ran.result["text/plain"] == "2"


def test_status_and_help(kernel):
    kernel.execute("#pragma taas --device cpu --gpus 1\nx_status = 1")
    status = kernel.execute("%taas status").stream("stdout")
    last_run = next(line for line in status.splitlines() if line.startswith("last run:"))
    assert "--gpus 1" in last_run and re.search(r", \d+\.\d\d s, ok$", last_run), last_run
    assert status.startswith("devices seen: ")
    assert "--gpus N" in kernel.execute("%taas help").stream("stdout")
    bad = kernel.execute("%taas nonsense")
    assert bad.reply["status"] == "error" and "UsageError: taas: unknown %taas command" in bad.stream("stderr")


def test_cell_without_process_group_runs_once_per_rank(kernel):
    ran = kernel.execute("#pragma taas --device cpu --gpus 3 --output all\nprint('hello')")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert sorted(line for line in ran.stream("stdout").splitlines() if "hello" in line) == [
        "[rank 0] hello", "[rank 1] hello", "[rank 2] hello"
    ]


def test_a_plain_cell_still_runs_in_the_kernel_itself(kernel):
    ran = kernel.execute("import os\nprint(os.getpid(), 'RANK' in os.environ, 'WORLD_SIZE' in os.environ)")
    assert ran.stream("stdout") == f"{kernel.pid} False False\n"


def test_two_notebooks_launching_at_once_do_not_clash(kernel, new_kernel):
    other = new_kernel()
    cell = (
        "#pragma taas --device cpu --gpus 2\nimport os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\nt = torch.ones(1)\ndist.all_reduce(t)\n"
        "dist.destroy_process_group()\n(os.environ['MASTER_PORT'], t.item())"
    )
    first = kernel.submit(cell)
    second = other.submit(cell)
    ran = [kernel.collect(*first), other.collect(*second)]
    for result in ran:
        assert result.reply["status"] == "ok", result.error_text()
    ports = [eval(result.result["text/plain"]) for result in ran]  # noqa: S307 - our own repr
    assert ports[0][1] == ports[1][1] == 2.0
    assert ports[0][0] != ports[1][0]


def test_a_flood_of_lines_shows_head_and_tail_keeps_all_in_a_log_and_few_messages(kernel):
    ran = kernel.execute(
        "#pragma taas --device cpu --gpus 2\nfor i in range(200000):\n    print('line', i)\nprint('done')", timeout=120
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    out = ran.stream("stdout")
    shown = [line for line in out.splitlines() if line.startswith("line ") or line == "done"]
    notice = re.search(r"\[taas\] (\d+) lines elided, full log at (\S+)", out)
    assert notice, out[-500:]
    everything = [f"line {i}" for i in range(200000)] + ["done"]
    head = shown[: shown.index("line 4999") + 1]
    assert head == everything[:5000] and shown[5000:] == everything[-200:]  # first and last lines, in order
    assert int(notice.group(1)) == len(everything) - 5200
    with open(notice.group(2)) as log:
        assert log.read().splitlines() == everything  # nothing lost
    streams = ran.of_type("stream")
    span = max(streams[-1].at - streams[0].at, 1.0)
    assert len(streams) <= 50 * span + 5  # coalesced: about 50 messages a second at most


def test_a_large_closure_reaches_the_ranks_through_one_shared_file(kernel):
    kernel.execute("import torch\nbig = torch.arange(3_000_000, dtype=torch.float64)\n"
                   "%config TaasMagics.closure_file_bytes = 1 << 20")
    try:
        ran = kernel.execute("#pragma taas --device cpu --gpus 2 --output all\nprint('sum', float(big.sum()), flush=True)")
        assert ran.reply["status"] == "ok", ran.error_text()
        expected = float(sum(range(3_000_000)))
        assert f"[rank 0] sum {expected}" in ran.stream() and f"[rank 1] sum {expected}" in ran.stream()
        assert "closure 24.0 MB (one shared file)" in ran.stream()
        assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"taas-closure-{kernel.pid}-")]
    finally:
        kernel.execute("%config TaasMagics.closure_file_bytes = 4 << 20\ndel big")
