"""What seeing the training costs a rank: taas.report in a tight step loop, and the health line.

    python bench/report.py [--repeats 7] [--steps 20000]

Measured in one run, in a 2-rank taas cell through a real kernel:

- a tight training loop (a small MLP's forward, backward and SGD step, about a tenth of a
  millisecond here: far tighter than any real model's) run bare and with
  ``taas.report(step=..., loss=...)`` every step, in ABAB pairs inside the same rank; the
  figure is the median of the paired ratios (target: within 5%), and the cost of one report. Beside it, what a
  person does instead: ``print`` the loss every step (to the cell), and torch's TensorBoard
  ``SummaryWriter.add_scalar`` where tensorboard is installed.
- the health line: what one health sample costs the rank (``rank/reports._health`` and its
  send, median of 1,000), as a share of the 2 s between samples (target: at most 1%).

Medians; the ratio of medians of pairs measured side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.kernel_client import Kernel  # noqa: E402

CELL = """\
#pragma taas --gpus 2
import os, statistics, time, torch, taas
from taas_magic.output import reports
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(16, 32), torch.randn(16, 1)

def loop(way, steps={steps}):
    started = time.perf_counter()
    for step in range(steps):
        opt.zero_grad()
        loss_tensor = torch.nn.functional.mse_loss(model(x), y)
        loss_tensor.backward()
        opt.step()
        loss = loss_tensor.item()
        if way == "report":
            taas.report(step=step, loss=loss)
        elif way == "print":
            print(f"step {{step}} loss {{loss:.4f}}")
        elif way == "tensorboard":
            writer.add_scalar("loss", loss, step)
    return time.perf_counter() - started

try:
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(log_dir=os.path.join("/tmp", f"taas-bench-tb-{{os.getpid()}}"))
    ways = ("report", "print", "tensorboard")
except ImportError:
    ways = ("report", "print")
ratios = {{way: [] for way in ways}}
bare_times = []
for _ in range({repeats}):
    for way in ways:
        bare = loop("bare")
        ratios[way].append(loop(way) / bare)
        bare_times.append(bare)
health = []
for _ in range(1000):
    started = time.perf_counter()
    reports._send(health=True)
    health.append(time.perf_counter() - started)
figures = (ratios, statistics.median(bare_times) / {steps}, statistics.median(health), reports.HEALTH_SECONDS)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20000)
    args = parser.parse_args()
    kernel = Kernel()
    try:
        ran = kernel.execute(CELL.format(steps=args.steps, repeats=args.repeats), timeout=1800)
        assert ran.reply["status"] == "ok", ran.error_text()
        ratios, step_seconds, health_seconds, interval = eval(  # noqa: S307 - our own cell's repr
            kernel.execute("figures").result["text/plain"])
    finally:
        kernel.shutdown()
    m = statistics.median
    print(f"bench/report.py: {args.repeats} ABAB pairs of {args.steps} steps on rank 0 of 2 (medians of paired ratios)")
    print(f"{'figure':<44} {'value':>12}  {'target':<12} beside")
    print(f"{'bare step':<44} {step_seconds * 1e6:9.1f} µs")
    per_report = (m(ratios["report"]) - 1) * step_seconds * 1e6
    print(f"{'taas.report every step: step time':<44} {m(ratios['report']):11.3f}x  {'<= 1.05x':<12} "
          + ", ".join(f"{way} every step {m(values):.3f}x" for way, values in ratios.items() if way != "report"))
    print(f"{'one report (from the paired ratio)':<44} {per_report:9.2f} µs")
    share = health_seconds / interval
    print(f"{'health sample (taken and sent)':<44} {health_seconds * 1e6:9.1f} µs  "
          f"{'<= 1%':<12} {100 * share:.4f}% of the rank's time (one per {interval:g} s)")


if __name__ == "__main__":
    main()
