"""What the straggler line costs a rank: DDP steps with taas timing their collectives, and without.

    python bench/steptiming.py [--repeats 9] [--steps 200]

Measured in one run, in a 2-rank taas cell (gloo, CPU) through a real kernel, inside the same ranks:

- a DDP step (forward, backward with DDP's gradient all-reduce, SGD step) of two models of the same shape: one as
  taas makes it (its all-reduce timed: output/collectives.py's hook), one with DDP's built-in C++ all-reduce (what a
  rank runs without taas's timing; taas leaves a model with a built-in hook alone), in ABAB pairs of ``--steps``
  steps; the figure is the median of the paired ratios (target: at most 1.01x), for a mid-size MLP (a step of tens of
  milliseconds here) and for a tiny one (a tenth of a millisecond: far tighter than a real model's step, where the
  fixed cost per bucket shows);
- a ``dist.all_reduce`` of one small tensor, timed (as the cell calls it) against torch's own function, the same way;
- beside them, what a person uses instead to see where a rank's time goes: ``torch.profiler.profile`` (CPU) around
  the same steps, paired the same way.

Medians of paired ratios, the number of pairs printed.
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
#pragma taas --device cpu --gpus 2
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import profile, ProfilerActivity
torch.set_num_threads(1)
dist.init_process_group("gloo")

def models(width, depth):
    def make():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(width, width) if i % 2 == 0 else torch.nn.ReLU() for i in range(2 * depth - 1)]
        return torch.nn.Sequential(*layers)
    timed = DDP(make())
    builtin = DDP(make())
    builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)  # DDP's own C++ all-reduce, untimed
    return timed, builtin

def run(model, x, steps, profiled=False):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    def loop():
        for _ in range(steps):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    started = time.perf_counter()
    if profiled:
        with profile(activities=[ProfilerActivity.CPU]):
            loop()
    else:
        loop()
    return time.perf_counter() - started

def pairs(width, depth, batch, steps):
    timed, builtin = models(width, depth)
    x = torch.randn(batch, width)
    run(timed, x, 3), run(builtin, x, 3)  # the first forward registers the hook; warm
    timing, profiling, bare = [], [], []
    for _ in range({repeats}):
        base = run(builtin, x, steps)
        timing.append(run(timed, x, steps) / base)
        profiling.append(run(builtin, x, steps, profiled=True) / run(builtin, x, steps))
        bare.append(base / steps)
    return timing, profiling, bare

def all_reduces(count=2000):
    tensor, ratios = torch.ones(16), []
    timed, plain = dist.all_reduce, dist.all_reduce.__taas_timed__
    for _ in range({repeats}):
        times = []
        for call in (plain, timed):
            started = time.perf_counter()
            for _ in range(count):
                call(tensor)
            times.append((time.perf_counter() - started) / count)
        ratios.append(times[1] / times[0])
    return ratios, times[0]

figures = {{"mid": pairs(1024, 4, 64, {steps}), "tiny": pairs(32, 2, 16, 10 * {steps}), "all_reduce": all_reduces()}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    kernel = Kernel()
    try:
        ran = kernel.execute(CELL.format(steps=args.steps, repeats=args.repeats), timeout=3600)
        assert ran.reply["status"] == "ok", ran.error_text()
        figures = eval(kernel.execute("figures").result["text/plain"])  # noqa: S307 - our own cell's repr
    finally:
        kernel.shutdown()
    m = statistics.median
    print(f"bench/steptiming.py: {args.repeats} ABAB pairs on rank 0 of 2 (gloo, CPU; medians of paired ratios)")
    print(f"{'figure':<52} {'value':>10}  {'target':<10} beside")
    for name, label, steps in (("mid", "DDP MLP 4x1024, batch 64", args.steps), ("tiny", "DDP MLP 2x32, batch 16",
                                                                                   10 * args.steps)):
        timing, profiling, bare = figures[name]
        print(f"{label + ': bare step':<52} {m(bare) * 1e3:8.3f} ms  {'':<10} ({steps} steps a pass)")
        print(f"{label + ': step, all-reduce timed':<52} {m(timing):9.4f}x  {'<= 1.01x':<10} "
              f"torch.profiler (CPU) around the steps {m(profiling):.3f}x")
    ratios, plain = figures["all_reduce"]
    print(f"{'dist.all_reduce of 16 floats, timed':<52} {m(ratios):9.4f}x  {'':<10} (torch's own: {plain * 1e6:.1f} µs)")


if __name__ == "__main__":
    main()
