"""taas.report over a real kernel: one live chart updated in place, taas.metrics(), the health
line and the rank the others wait for, a no-op outside a run, and a rank reporting 100,000 times."""

import re


def _displays(ran, prefix: str) -> list[tuple[str, dict]]:
    """(message type, content) of the displays whose display_id starts with ``prefix``."""
    return [(message.type, message.content) for message in ran.messages
            if message.type in ("display_data", "update_display_data")
            and message.content.get("transient", {}).get("display_id", "").startswith(prefix)]


REPORTING = """\
#pragma taas --device cpu --gpus 2
import os, time, taas
rank = int(os.environ["RANK"])
for step in range(40):
    taas.report(step=step * 10, loss=1.0 / (step + 1) + rank * 0.01, lr=0.1)
    time.sleep(0.05 if rank == 0 else 0.12)
"""


def test_one_chart_updated_in_place_and_the_metrics_after_the_cell(kernel):
    ran = kernel.execute(REPORTING)
    assert ran.reply["status"] == "ok", ran.error_text()
    charts = _displays(ran, "taas-chart-")
    assert charts[0][0] == "display_data" and all(kind == "update_display_data" for kind, _ in charts[1:])
    assert len({content["transient"]["display_id"] for _, content in charts}) == 1
    assert charts[0][1]["data"] == {"text/plain": ""}  # its place, above the ranks' output, before they start
    images = [content["data"]["image/svg+xml"] for _, content in charts[1:]]
    assert len(set(images)) >= 3  # it changed while the cell ran
    assert all(image.startswith("<svg") and ">loss</text>" in image and ">lr</text>" in image for image in images)
    assert "every rank's min-max" in images[-1]  # both ranks report loss: rank 0's line over the band
    # about 2 s of reports (rank 1's pace): at most about two images a second, and one at the end
    assert len(charts) <= 2 * ran.reply_at + 3, (len(charts), ran.reply_at)
    reports = kernel.execute("import taas\nm = taas.metrics()\n(len(m), m[0], m[-1]['step'])").result["text/plain"]
    assert reports == "(40, {'step': 0, 'loss': 1.0, 'lr': 0.1}, 390)"


SLOWED = """\
#pragma taas --device cpu --gpus 2
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 64)
def step(pause):
    time.sleep(pause)  # the rank's own work, as the straggler line sees it: time in no collective
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
for _ in range(45):
    step(0.1 if rank == 1 else 0.03)  # rank 1 lags: about 4.5 s
for _ in range(170):
    step(0.03)  # then it keeps up: about 5 s
"""


def test_a_slowed_ddp_rank_is_named_while_it_lags_the_fast_one_never_and_the_chart_draws_the_waits(kernel):
    ran = kernel.execute(SLOWED)
    assert ran.reply["status"] == "ok", ran.error_text()
    lines = [content["data"]["text/plain"] for _, content in _displays(ran, "taas-health-")]
    assert lines[0] == "taas health · starting 2 rank(s)"
    lines = lines[1:]
    assert lines and all(line.startswith("taas health · rank 0:") and " | rank 1:" in line for line in lines)
    named = [line for line in lines if "taas straggler · " in line]
    assert named, lines  # rank 1 lagged for about 4.5 s: the line named it
    sentence = re.search(r"taas straggler · rank 1 is (\d+\.\d)x slower than the others; they wait (\d+)% of each "
                         r"step for it", named[0])
    assert sentence and float(sentence[1]) >= 1.25 and int(sentence[2]) >= 20, named[0]
    assert all("taas straggler · rank 1 is " in line for line in named), named  # the fast rank is never named
    for line in named:  # rank 1's part of the line is marked, never rank 0's
        rank_0, rank_1 = line.splitlines()[0].split(" | ")
        assert "← straggler" not in rank_0 and rank_1.endswith("← straggler"), line
    # every rank's step split into working and waiting, the fast rank waiting more
    split = re.findall(r"rank (\d): .*?(\d+\.\d+ m?s)/step: (\d+\.\d+ m?s) working, (\d+\.\d+ m?s) waiting", named[0])
    assert [rank for rank, *_ in split] == ["0", "1"], named[0]
    assert "taas straggler" not in lines[-1], lines[-1]  # it kept up for the last 5 s: the line went away
    charts = _displays(ran, "taas-chart-")
    image = charts[-1][1]["data"]["image/svg+xml"]
    assert "waiting in collectives, % (x: seconds)" in image and "every rank's min-max" in image


def test_report_outside_a_run_does_nothing(kernel):
    ran = kernel.execute("import taas\ntaas.report(step=1, loss=0.5)\ntaas.report(loss=2)")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert not ran.messages or all(message.type not in ("stream", "display_data") for message in ran.messages)


# CPU time (the rank's, every thread's: the sender's too), not wall time: what reporting costs the rank is the
# same on a busy machine, where wall time also counts the moments the rank waited to be scheduled
TIGHT = """\
#pragma taas --device cpu --gpus 2
import time, taas, torch
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt, x, y = torch.optim.SGD(model.parameters(), lr=1e-3), torch.randn(16, 32), torch.randn(16, 1)
def train_step():  # about the tightest real training step there is: a tiny MLP on a tiny batch
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
started = time.process_time()
for _ in range(1000):
    train_step()
step_seconds = (time.process_time() - started) / 1000
def loop(reporting):
    started = time.process_time()
    for step in range(100_000):
        if reporting:
            taas.report(step=step, loss=step * 1e-5)
    return time.process_time() - started
plain = min(loop(False) for _ in range(3))
with_reports = loop(True)
"""


def test_a_tight_loop_of_100000_reports_neither_floods_the_cell_nor_slows_the_rank(kernel):
    ran = kernel.execute(TIGHT)
    assert ran.reply["status"] == "ok", ran.error_text()
    charts = _displays(ran, "taas-chart-")
    assert 1 <= len(charts) <= 2 * ran.reply_at + 3  # at most about two images a second, however fast it reports
    assert sum(message.type == "stream" for message in ran.messages) < 20
    # 100,000 reports cost the rank less than 5% of as many of the tightest real training steps
    share = float(kernel.execute("(with_reports - plain) / (100_000 * step_seconds)").result["text/plain"])
    assert share < 0.05, f"reporting every step would slow a tiny MLP's training by {share:.1%}"
    # taas.metrics() after 100,000 reports: the first, an evenly thinned past, the last 10,000 exactly (output/board.py)
    count = kernel.execute("import taas\nm = taas.metrics()\n(len(m) <= 20_000, m[0], m[-1], "
                           "[r['step'] for r in m[-10_000:]] == list(range(90_000, 100_000)))").result["text/plain"]
    assert count == "(True, {'step': 0, 'loss': 0.0}, {'step': 99999, 'loss': 0.99999}, True)"
