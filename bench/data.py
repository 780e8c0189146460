"""Time per pass: a costly loader in the ranks, with DataLoader workers, and registered with taas.

    python bench/data.py [--repeats 3] [--elements 256] [--work cpu,sleep]

Two ranks (gloo, through a real kernel) train on a loader whose elements (MNIST-shaped
batches, 64x1x28x28) cost about 20 ms each to prepare; a training step costs about 5 ms
and all-reduces, as DDP does. Side by side, in one run, medians of --repeats:

- plain: the loader in the ranks (``num_workers=0``, DistributedSampler);
- DataLoader(num_workers=M/N) in each of the N = 2 ranks, M = 2 and 4: M worker processes
  in all, the same number as ...
- ... registered with ``taas.register`` and run with ``--cpus M`` (M workers in all);
- the second pass of each; for the registered loader (``--units`` = one pass) that is a
  pass replayed from the cache;
- the whole cell (execute request to reply, as the person waits): the workers start
  before the ranks and prepare elements while the ranks start, which a pass timed
  inside the ranks does not see.

``--work cpu`` burns the 20 ms and 5 ms on the CPU (the issue's definition: decoding,
augmentation); on a machine with fewer cores than ranks + workers, preparation and
training then compete for the same cores, and no arrangement of processes can beat the
core count. ``--work sleep`` spends them waiting (slow storage, a remote decode), where
only the overlap of preparation with training counts.

Printed beside the figures: the targets' ratios (registered --cpus M vs
DataLoader(num_workers=M/N) in each rank, the same total of worker processes; first pass /
replayed pass; pass under extraction vs max(preparation / M, training) + 10%).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.kernel_client import Kernel  # noqa: E402

ELEMENT_SECONDS = 0.020
STEP_SECONDS = 0.005

SETUP = """
import time, torch, taas
from torch.utils.data import DataLoader, Dataset

def spend(seconds, work):
    if work == "sleep":
        time.sleep(seconds)
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass

class Costly(Dataset):
    '''Each item is one MNIST-shaped batch that takes ~20 ms to prepare.'''
    def __init__(self, n, work):
        self.n, self.work = n, work
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        spend({element}, self.work)
        return torch.full((64, 1, 28, 28), float(i)), torch.full((64,), i % 10)
"""

CELL = """#pragma taas --gpus 2 {options}
import time, torch, torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
dist.init_process_group("gloo")
{loader}
times = []
for epoch in range(2):
    if isinstance(getattr(loader, "sampler", None), DistributedSampler):
        loader.sampler.set_epoch(epoch)
    dist.barrier()
    started = time.perf_counter()
    for x, y in loader:
        spend({step}, WORK)
        dist.all_reduce(torch.ones(1))
    dist.barrier()
    times.append(time.perf_counter() - started)
print("pass-times", times[0], times[1], flush=True)
dist.destroy_process_group()
"""

IN_RANKS = (
    "dataset = Costly({elements}, WORK)\n"
    "loader = DataLoader(dataset, batch_size=None, sampler=DistributedSampler(dataset), num_workers={workers})"
)


RANKS = 2
TOTAL_WORKERS = (2, 4)  # M: worker processes in all, whichever way they are arranged


def _in_ranks(m: int) -> str:
    return f"DataLoader(num_workers={m // RANKS}) in each rank [{m} in all]"


def configurations(elements: int) -> list[tuple[str, str, str, int]]:
    """(label, pragma options, loader line, M)."""
    rows = [("plain loader in the ranks", "", IN_RANKS.format(elements=elements, workers=0), 0)]
    for m in TOTAL_WORKERS:
        rows.append((_in_ranks(m), "", IN_RANKS.format(elements=elements, workers=m // RANKS), m))
        rows.append((f"registered, --cpus {m}", f"--cpus {m}", "loader = registered", m))
    return rows


def run_mode(kernel: Kernel, work: str, elements: int, repeats: int) -> dict[str, list[list[float]]]:
    ran = kernel.execute(
        f"WORK = {work!r}\nregistered = taas.register(DataLoader(Costly({elements}, WORK), batch_size=None, shuffle=True))"
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    results: dict[str, list[list[float]]] = {}
    for _ in range(repeats):  # interleaved, so drift in the machine's load hits every configuration
        for label, options, loader, _m in configurations(elements):
            cell = CELL.format(options=options, loader=loader, step=STEP_SECONDS)
            ran = kernel.execute(cell, timeout=600)
            assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
            first, second = map(float, re.search(r"pass-times (\S+) (\S+)", ran.stream("stdout")).groups())
            for column, value in zip(results.setdefault(label, [[], [], []]), (first, second, ran.reply_at)):
                column.append(value)
    kernel.execute("taas.unregister(registered)")
    return results


def report(work: str, elements: int, results: dict[str, list[list[float]]]) -> None:
    median = {label: [statistics.median(column) for column in columns] for label, columns in results.items()}
    print(f"\n--work {work}: {elements} elements of ~{ELEMENT_SECONDS * 1e3:.0f} ms, "
          f"steps of ~{STEP_SECONDS * 1e3:.0f} ms, 2 ranks (medians of {len(next(iter(results.values()))[0])})")
    print(f"{'configuration':42} {'first pass':>11} {'second pass':>12} {'whole cell':>11}")
    for label, (first, second, whole) in median.items():
        note = "  (second pass replayed from the cache)" if label.startswith("registered") else ""
        print(f"{label:42} {first:10.3f}s {second:11.3f}s {whole:10.3f}s{note}")
    preparation = elements * ELEMENT_SECONDS
    training = elements / 2 * STEP_SECONDS
    print("targets (first pass timed in the ranks; whole cell in brackets):")
    for m in TOTAL_WORKERS:
        ours = median[f"registered, --cpus {m}"]
        theirs = median[_in_ranks(m)]
        bound = max(preparation / m, training) * 1.1
        print(f"  --cpus {m} vs DataLoader(num_workers={m // RANKS}) in each of {RANKS} ranks ({m} worker processes "
              f"either way): {theirs[0] / ours[0]:.2f}x as fast [{theirs[2] / ours[2]:.2f}x] (target >= 1.00x)")
        print(f"  --cpus {m} first pass / (max(preparation/M, training) + 10% = {bound:.2f}s): "
              f"{ours[0] / bound:.2f} (target <= 1.00)")
    for m in TOTAL_WORKERS:
        first, replay = median[f"registered, --cpus {m}"][:2]
        ceiling = max(preparation / m, training) / training  # first pass >= prep/M, a replay >= training
        print(f"  --cpus {m}: replayed pass {first / replay:.1f}x faster than the first "
              f"(at most ~{ceiling:.1f}x possible here; target >= 5x where preparation dominates)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--elements", type=int, default=256)
    parser.add_argument("--work", default="cpu,sleep", help="cpu, sleep or both (cpu,sleep)")
    args = parser.parse_args()
    kernel = Kernel()
    try:
        ran = kernel.execute(SETUP.format(element=ELEMENT_SECONDS))
        assert ran.reply["status"] == "ok", ran.error_text()
        for work in args.work.split(","):
            report(work, args.elements, run_mode(kernel, work, args.elements, args.repeats))
    finally:
        kernel.shutdown()


if __name__ == "__main__":
    main()
