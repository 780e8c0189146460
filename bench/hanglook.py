"""What the hang line costs a rank's training: its look at the cell's thread, beside a step without it.

    python bench/hanglook.py [--pairs 31] [--steps 200] [--every 0.01]

The rank's half of the hang line (taas_magic/autopsy/waiting.py) is one look at the main thread's innermost
frame (``sys._current_frames``) with each health figure, every 2 s, on the reports thread. Rows, in this
process (no kernel: the kernel's half reads a number from each health frame and acts only past the
threshold):

- one look: ``waiting.waited`` called 10 000 times from another thread while the main thread trains, median
  and p99 per call; and that, per 2 s of training, as a share of the time (the rate a rank pays);
- a step with looks beside a step without: ``--pairs`` ABBA pairs of ``--steps`` training steps each (a small MLP,
  forward, backward and SGD on one thread, as a CPU rank's), a thread of its own waking to look every ``--every``
  s (default 0.01: 200 times the rank's rate, so that a cost too small to see at the real rate shows; its wake-ups
  take the GIL from the step, which the rank's looks do not add: they ride the reports thread's wake-up every
  0.25 s that is there anyway); the median of the paired ratios and its 95% interval (bench/intervals.py); then
  the excess scaled to a rank's rate, against the floor: **at most 1.005x** (0.5% of a step).

What a person would use instead (torchrun, a plain process) looks at nothing: 1.000x. The machine (cores, kernel,
torch) is printed first.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.intervals import median_interval  # noqa: E402
from taas_magic.autopsy import waiting  # noqa: E402
from taas_magic.cell.options import HANG_SECONDS  # noqa: E402

FLOOR = 1.005
HEALTH_SECONDS = 2.0  # output/reports.py's: how often a rank looks


def model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    return net, torch.optim.SGD(net.parameters(), lr=0.01)


def train(net: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> float:
    """``steps`` steps on the main thread; their seconds."""
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    return time.perf_counter() - started


def looking(every: float, stop: threading.Event) -> threading.Thread:
    """A thread that looks as the reports thread does, every ``every`` s until ``stop``."""
    def run() -> None:
        while not stop.wait(every):
            waiting.waited(time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def one_look(net: torch.nn.Module, optimizer: torch.optim.Optimizer, count: int = 10_000) -> list[float]:
    """Seconds per look, from another thread while the main thread trains."""
    seconds: list[float] = []
    done = threading.Event()

    def run() -> None:
        for _ in range(count):
            started = time.perf_counter()
            waiting.waited(time.monotonic())
            seconds.append(time.perf_counter() - started)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    while not done.is_set():
        train(net, optimizer, 5)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=31)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=float, default=0.01)
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    print(f"bench/hanglook.py: {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
          f"Python {platform.python_version()}, torch {torch.__version__}; --hang {HANG_SECONDS:g} s by default")
    net, optimizer = model()
    train(net, optimizer, arguments.steps)  # warm
    looks = sorted(one_look(net, optimizer))
    per_look = statistics.median(looks)
    ratios, with_looks, without = [], [], []
    for pair in range(arguments.pairs):
        times = {}
        for side in ("without", "with") if pair % 2 == 0 else ("with", "without"):
            stop = threading.Event()
            thread = looking(arguments.every, stop) if side == "with" else None
            times[side] = train(net, optimizer, arguments.steps)
            stop.set()
            if thread is not None:
                thread.join()
        with_looks.append(times["with"] / arguments.steps)
        without.append(times["without"] / arguments.steps)
        ratios.append(times["with"] / times["without"])
    low, high = median_interval(ratios)
    ratio = statistics.median(ratios)
    print(f"{arguments.pairs} ABBA pairs of {arguments.steps} steps; looks every {arguments.every:g} s "
          f"({HEALTH_SECONDS / arguments.every:.0f}x a rank's rate)\n")
    print("| row | with the looks | without (a plain process) | paired ratio | its 95% interval | target |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(f"| one look (waiting.waited) | {per_look * 1e6:.1f} us (p99 {looks[int(0.99 * len(looks))] * 1e6:.1f} us) | "
          f"none | | | |")
    print(f"| its share of a rank's time, one look every {HEALTH_SECONDS:g} s | {per_look / HEALTH_SECONDS:.6%} | 0% | "
          "| | <= 0.5% |")
    scale = arguments.every / HEALTH_SECONDS
    at_rate = 1 + (ratio - 1) * scale
    print(f"| a training step, a thread looking every {arguments.every:g} s | {statistics.median(with_looks) * 1e3:.3f} ms | "
          f"{statistics.median(without) * 1e3:.3f} ms | {ratio:.4f}x | {low:.4f}-{high:.4f}x | (a stress: "
          f"{HEALTH_SECONDS / arguments.every:.0f}x the rate) |")
    print(f"| the same at a rank's rate (the excess scaled by {scale:g}) | | | {at_rate:.6f}x | "
          f"{1 + (low - 1) * scale:.6f}-{1 + (high - 1) * scale:.6f}x | "
          f"<= {FLOOR}x: {'met' if at_rate <= FLOOR else 'not met'} |")


if __name__ == "__main__":
    main()
