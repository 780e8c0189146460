"""What the run log and the live widget cost: a run's steps/s beside today's, and the kernel's memory in a flood.

    python bench/view.py [--pairs 4] [--steps 3000] [--lines 1000000] [--baseline 23e1302]

Measured in one run, side by side, through real kernels driven by jupyter_client:

- today's: the commit before the run log (``--baseline``, checked out in a temporary git
  worktree and imported from there), its run shown as the cell's stream output;
- now, widget: this checkout, its client opening the widget manager's control comm as a
  page does, so the run is shown as its live widget (fed from the run log by its pump);
- now, stream: this checkout with ``TaasMagics.view = 'stream'`` (the run log alone).

The cell: 2 CPU ranks train a small MLP (DDP, gloo) for ``--steps`` steps, each step printing a ``\\r``
progress line and calling ``taas.report(loss=...)`` (far more output than a real run's);
rank 0's steps/s is the cell's value. The order is A B B A per pair (A today's, B now,
widget and stream taking turns), one kernel per variant, warmed by a first cell; the
figure is the median over pairs of (B's two runs) / (A's two runs), target at most 1% slower.
Beside it, the kernel's own CPU seconds per run (user + system): what showing the run costs
the host, a steadier figure than steps/s on a shared 2-core machine.

Memory: a cell whose rank 0 prints ``--lines`` lines as fast as it can, in a fresh kernel of
each variant; the kernel's resident memory before the cell and its peak during it (psutil,
every 20 ms), and the run log's size on disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.kernel_client import Kernel  # noqa: E402

TRAIN = """\
#pragma taas --device cpu --gpus 2
import time, torch, taas
import torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
x, y = torch.randn(32, 64), torch.randn(32, 1)
steps, started = 0, time.perf_counter()
while steps < {steps}:  # a count, not a clock: every rank takes the same number of DDP steps
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(ddp(x), y)
    loss.backward()
    opt.step()
    steps += 1
    taas.report(loss=loss)
    print(f"\\rstep {{steps}} loss {{loss.item():.4f}}", end="", flush=True)
print()
rate = steps / (time.perf_counter() - started)
dist.destroy_process_group()
rate
"""

FLOOD = """\
#pragma taas --device cpu --gpus 2
import os, sys
if os.environ["RANK"] == "0":
    write = sys.stdout.write
    for i in range({lines}):
        write(f"line {{i}} of the flood, about sixty characters long in all\\n")
    sys.stdout.flush()
"""


def _widget_page(kernel: Kernel) -> None:
    """What a page's widget manager does when it connects: open the control comm."""
    message = kernel.client.session.msg("comm_open", {"comm_id": "bench-page", "target_name": "jupyter.widget.control",
                                                      "data": {}}, metadata={"version": "1.0.0"})
    kernel.client.shell_channel.send(message)
    kernel.execute("1")


def _kernel(source: Path, variant: str) -> Kernel:
    kernel = Kernel(env={"PYTHONPATH": str(source)})
    if variant == "widget":
        _widget_page(kernel)
    elif variant == "stream":
        kernel.execute("%config TaasMagics.view = 'stream'")
    return kernel


def _rate(kernel: Kernel, steps: int) -> tuple[float, float]:
    """Rank 0's steps/s, and the kernel's CPU seconds for the run (what showing it cost the host)."""
    process = psutil.Process(kernel.pid)
    before = sum(process.cpu_times()[:2])
    ran = kernel.execute(TRAIN.format(steps=steps), timeout=600)
    assert ran.reply["status"] == "ok", ran.error_text()
    return float(ran.result["text/plain"]), sum(process.cpu_times()[:2]) - before


def _flood(source: Path, variant: str, lines: int) -> tuple[int, int, int]:
    """(resident before, peak during, the run log's bytes on disk) for a run that prints ``lines`` lines."""
    logs = Path(tempfile.mkdtemp(prefix="taas-bench-logs-"))
    kernel = Kernel(env={"PYTHONPATH": str(source), "TAAS_LOG_DIR": str(logs)})
    try:
        if variant == "widget":
            _widget_page(kernel)
        kernel.execute("#pragma taas --device cpu --gpus 2\n1")  # warm: the extension and its imports
        process = psutil.Process(kernel.pid)
        before = process.memory_info().rss
        peak = [before]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], process.memory_info().rss)
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        ran = kernel.execute(FLOOD.format(lines=lines), timeout=1200)
        done.set()
        sampler.join()
        assert ran.reply["status"] == "ok", ran.error_text()
        on_disk = sum(path.stat().st_size for path in logs.glob("*.run.jsonl"))
        return before, peak[0], on_disk
    finally:
        kernel.shutdown()
        shutil.rmtree(logs, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--baseline", default="23e1302", help="today's: the commit before the run log")
    parser.add_argument("--memory-only", action="store_true", help="only the flood's memory figures")
    args = parser.parse_args()
    old = Path(tempfile.mkdtemp(prefix="taas-bench-baseline-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(old), args.baseline], check=True)
    try:
        sources = {"today": old, "widget": ROOT, "stream": ROOT}
        kernels = {variant: _kernel(source, variant) for variant, source in sources.items()}
        rates: dict[str, list[float]] = {variant: [] for variant in sources}
        cpu: dict[str, list[float]] = {variant: [] for variant in sources}
        ratios: dict[str, list[float]] = {"widget": [], "stream": []}
        try:
            for kernel in kernels.values():
                _rate(kernel, 200)  # warm: spares, imports
            for pair in range(0 if args.memory_only else args.pairs):
                now = "widget" if pair % 2 == 0 else "stream"
                order = ["today", now, now, "today"]
                got = {variant: [] for variant in set(order)}
                for variant in order:
                    rate, seconds = _rate(kernels[variant], args.steps)
                    got[variant].append(rate)
                    rates[variant].append(rate)
                    cpu[variant].append(seconds)
                ratios[now].append(sum(got[now]) / sum(got["today"]))
        finally:
            for kernel in kernels.values():
                kernel.shutdown()
        memory = {variant: _flood(source, variant, args.lines) for variant, source in (("today", old), ("widget", ROOT))}
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
    m = statistics.median
    print(f"bench/view.py: {args.pairs} ABBA pairs of {args.steps}-step runs (2 CPU ranks, a \\r line and a report "
          f"every step); today's = {args.baseline}; host {os.cpu_count()} cores")
    print(f"{'figure':<46} {'value':>12}  {'target':<14} beside")
    if rates["today"]:
        print(f"{'steps/s, today (stream output)':<46} {m(rates['today']):12.0f}  {'':<14} {len(rates['today'])} runs; "
              f"kernel CPU {m(cpu['today']):.2f} s a run")
    for variant in ("widget", "stream"):
        if ratios[variant]:
            change = m(ratios[variant]) - 1
            print(f"{f'steps/s, now ({variant}, with the run log)':<46} {m(rates[variant]):12.0f}  {'':<14} "
                  f"{len(rates[variant])} runs; kernel CPU {m(cpu[variant]):.2f} s a run")
            print(f"{f'  paired ratio now/today ({variant})':<46} {m(ratios[variant]):11.3f}x  {'>= 0.99x':<14} "
                  f"{abs(100 * change):.1f}% {'faster' if change >= 0 else 'slower'}; "
                  f"pairs {', '.join(f'{r:.3f}' for r in ratios[variant])}")
    for variant, (before, peak, on_disk) in memory.items():
        label = f"kernel RSS, {args.lines:,} lines ({variant})"
        print(f"{label:<46} {peak / 2**20:9.0f} MB  {'bounded':<14} {before / 2**20:.0f} MB before, "
              f"+{(peak - before) / 2**20:.0f} MB at the peak; run log on disk {on_disk / 2**20:.0f} MB")


if __name__ == "__main__":
    main()
