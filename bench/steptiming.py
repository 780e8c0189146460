"""What the straggler line costs a rank: DDP steps with taas timing their collectives, and without.

    python bench/steptiming.py [--repeats 9] [--steps 200]

Measured in one run, in a 1-rank and then a 2-rank taas cell (gloo, CPU) through a real kernel, inside the same
ranks (one rank shows the rank's own cost; with two, gloo's coupling of the ranks on two cores adds noise):

- a DDP step (forward, backward with DDP's gradient all-reduce, SGD step) of models of the same shape: one as taas
  makes it (its all-reduce timed: DDP's own timer sampled about every 0.1 s of its steps, read after steps on the
  cell's thread, output/ddptiming.py), one left to DDP's own logging (one iteration in 100, never read: what a rank
  runs without taas's timing), and a second such model (the floor: the method's own bias and noise, untimed over
  untimed), single steps of each
  interleaved in an order shuffled alike on every rank; per chunk of ``--steps`` steps of each, the ratio of their
  median steps; the figure is the median of the chunks' ratios (target: at most 1.01x), for a mid-size MLP (a step
  of tens of milliseconds here) and for a tiny one (a millisecond or two: far tighter than a real model's step);
- a ``dist.all_reduce`` of one small tensor through the timer alone against torch's own function, the same way (in
  ranks other than 0 ``dist.all_reduce`` is also the overlay's refresh: bench/repoview.py measures that);
- beside them, what a person uses instead to see where a rank's time goes: ``torch.profiler.profile`` (CPU) around
  the same steps, paired the same way.

Medians of the chunks' ratios, with their spread, the number of chunks printed.
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
#pragma taas --device cpu --gpus {ranks}
import gc, random, statistics, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import profile, ProfilerActivity
from taas_magic.output import ddptiming
torch.set_num_threads(1)
dist.init_process_group("gloo")

def models(width, depth):
    def make():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(width, width) if i % 2 == 0 else torch.nn.ReLU() for i in range(2 * depth - 1)]
        return torch.nn.Sequential(*layers)
    timed = DDP(make())  # as taas makes it: its all-reduce timed from DDP's own timer
    plain, again = DDP(make()), DDP(make())  # and twice as DDP runs without taas: the floor is their ratio
    for untimed in (plain, again):
        ddptiming.times.leave(untimed)  # DDP's own logging rate, never read
    return timed, plain, again

def stepper(model, x):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    def step():
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    return step

def run(step, steps, profiled=False):
    started = time.perf_counter()
    if profiled:
        with profile(activities=[ProfilerActivity.CPU]):
            for _ in range(steps):
                step()
    else:
        for _ in range(steps):
            step()
    return time.perf_counter() - started

def pairs(width, depth, batch, steps):
    # single steps of the two models interleaved in an order shuffled alike on every rank (each as often first:
    # a pass of one model after a pass of the other was favoured by where it fell); per chunk of `steps` steps of
    # each, the ratio of their median step times
    gc.collect()  # the last pair's optimizers gone: this pair's first to step paces the steps (rank/steps.py)
    timed, plain, again = models(width, depth)
    x = torch.randn(batch, width)
    steppers = {{"timed": stepper(timed, x), "plain": stepper(plain, x), "again": stepper(again, x)}}
    for step in steppers.values():
        run(step, 20)  # warm (DDP's first ten iterations are all sampled)
    rng = random.Random(0)  # the same order on every rank: their collectives pair up
    timing, floor, profiling, bare = [], [], [], []
    for _ in range({repeats}):
        times = {{"timed": [], "plain": [], "again": []}}
        for _ in range(steps):
            order = ["timed", "plain", "again"]
            rng.shuffle(order)
            for name in order:
                started = time.perf_counter()
                steppers[name]()
                times[name].append(time.perf_counter() - started)
        base = statistics.median(times["plain"])
        timing.append(statistics.median(times["timed"]) / base)
        floor.append(statistics.median(times["again"]) / base)
        profiling.append(run(steppers["plain"], steps, profiled=True) / run(steppers["plain"], steps))
        bare.append(base)
    return timing, floor, profiling, bare

def all_reduces(count=2000):
    tensor, ratios = torch.ones(16), []
    from taas_magic.output.collectives import timed as timer
    plain = dist.all_reduce.__taas_timed__  # torch's own (dist.all_reduce is also the overlay's refresh in rank 1)
    timed = timer(plain)  # the timer alone, as it wraps torch's
    bare = []
    for repeat in range({repeats}):
        times = {{}}
        for call in ((plain, timed) if repeat % 2 else (timed, plain)):  # each first in half the repeats
            started = time.perf_counter()
            for _ in range(count):
                call(tensor)
            times[call] = (time.perf_counter() - started) / count
        ratios.append(times[timed] / times[plain])
        bare.append(times[plain])
    return ratios, statistics.median(bare)

figures = {{"mid": pairs(1024, 4, 64, {steps}), "tiny": pairs(32, 2, 16, 10 * {steps}), "all_reduce": all_reduces()}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    results = {}
    for ranks in (1, 2):
        kernel = Kernel()
        try:
            ran = kernel.execute(CELL.format(steps=args.steps, repeats=args.repeats, ranks=ranks), timeout=3600)
            assert ran.reply["status"] == "ok", ran.error_text()
            results[ranks] = eval(kernel.execute("figures").result["text/plain"])  # noqa: S307 - our own cell's repr
        finally:
            kernel.shutdown()
    m = statistics.median
    print(f"bench/steptiming.py: {args.repeats} chunks of single steps interleaved in a shuffled order, on rank 0 of "
          "a 1-rank and a 2-rank cell (gloo, CPU; medians of the chunks' ratios of median steps, min-max)")
    print(f"{'figure':<58} {'value':>26}  {'target':<10} beside")
    for ranks, figures in results.items():
        for name, label, steps in (("mid", "DDP MLP 4x1024, batch 64", args.steps),
                                   ("tiny", "DDP MLP 2x32, batch 16", 10 * args.steps)):
            timing, floor, profiling, bare = figures[name]
            print(f"{f'{ranks} rank(s), {label}: bare step':<58} {m(bare) * 1e3:23.3f} ms  {'':<10} "
                  f"({steps} steps of each a chunk)")
            spread = f"{m(timing):.4f}x ({min(timing):.3f}-{max(timing):.3f})"
            print(f"{f'{ranks} rank(s), {label}: step, all-reduce timed':<58} {spread:>26}  {'<= 1.01x':<10} "
                  f"torch.profiler (CPU) around the steps {m(profiling):.3f}x")
            spread = f"{m(floor):.4f}x ({min(floor):.3f}-{max(floor):.3f})"
            print(f"{f'{ranks} rank(s), {label}: floor, untimed over untimed':<58} {spread:>26}  {'':<10} "
                  "(the method's own bias and noise)")
        ratios, plain = figures["all_reduce"]
        spread = f"{m(ratios):.4f}x ({min(ratios):.3f}-{max(ratios):.3f})"
        print(f"{f'{ranks} rank(s), dist.all_reduce of 16 floats, timed':<58} {spread:>26}  {'':<10} "
              f"(torch's own: {plain * 1e6:.1f} µs)")


if __name__ == "__main__":
    main()
