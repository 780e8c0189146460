"""A cell's start, beside its floors: the three figures a release must not regress.

    python bench/start.py [--kernels 5] [--warm 3] [--megabytes 200] [--cold-only] [--kernel taas|python3]

Through real kernels (jupyter_client), ``--device cpu --gpus 2`` (gloo), the time a person
waits: execute_request -> rank 0's first line on iopub. Per fresh kernel, in this order:

- floor: two ``python -c "import torch"`` started in parallel, until both have imported it
  (what any launcher of two fresh torch processes pays at least), measured right before the
  kernel starts, so each cold cell has its own floor (the paired ratio);
- cold: the kernel's first taas cell, a DDP cell whose first line is printed after its imports
  and before ``init_process_group``, as bench/launch.py's loop does (the method the figures of
  earlier rounds were taken with); target: at most 0.95x its floor. The kernel is "Python 3
  (taas)", which loads the extension as it starts, and the cell is sent the moment it answers
  (``--kernel taas``, the default); with ``--kernel python3`` it is a plain kernel, the cell
  ``%load_ext taas_magic`` runs first and the cold cell is sent the moment that replies, so
  the spare factory (started as the extension loads) has had no head start at all;
- warm: the same cell 5 s after the last one replied (its warm spares ready), ``--warm``
  times per kernel; target: at most 0.04 s; beside it, as many cells printing their line
  after ``init_process_group`` (the process group made too: no target);
- capture: a cell that captures a ``--megabytes`` tensor from the notebook and prints first
  thing, 5 s after the last, beside the floor of ``torch.save`` then ``torch.load`` of the same
  tensor through ``/dev/shm`` in one process; target: at most 1.2x that floor (paired).

Medians (min, max) over every sample, and the number of samples; ratios are paired per
sample (a noisy 2-core machine moves both sides of a pair together).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.launch import floor_seconds, wait_for_spares  # noqa: E402
from tests.kernel_client import Kernel  # noqa: E402

# the start of bench/launch.py's DDP loop, whose first line the figures of earlier rounds were taken at: after
# the imports, before init_process_group (DDP_INIT_CELL prints after it, a stricter figure, shown beside)
DDP_CELL = (
    "#pragma taas --device cpu --gpus 2\n"
    "import os, time, torch, torch.distributed as dist\n"
    "print('first-line', flush=True)\n"
    "dist.init_process_group('gloo', init_method='env://')\n"
    "dist.all_reduce(torch.ones(1))\n"
    "dist.destroy_process_group()\n"
)
DDP_INIT_CELL = DDP_CELL.replace("print('first-line', flush=True)\n", "").replace(
    "dist.init_process_group('gloo', init_method='env://')\n",
    "dist.init_process_group('gloo', init_method='env://')\nprint('first-line', flush=True)\n")
CAPTURE_CELL = "#pragma taas --device cpu --gpus 2\nprint('first-line', capture.numel(), flush=True)\n"
PAUSE = 5.0  # seconds after the last cell's reply: a person reading the output, then rerunning
SAVE_LOAD = (
    "import os, time, torch\n"
    "path = f'/dev/shm/taas-bench-{os.getpid()}.pt'\n"
    "started = time.perf_counter()\n"
    "torch.save(capture, path)\n"
    "torch.load(path)\n"
    "print(f'floor {time.perf_counter() - started:.6f}')\n"
    "os.remove(path)\n"
)


def first_line(kernel: Kernel, cell: str) -> float:
    msg_id, started = kernel.submit(cell)
    kernel.wait_for_stream(msg_id, "first-line", timeout=120)
    seconds = time.monotonic() - started
    ran = kernel.collect(msg_id, started, timeout=120)
    if ran.reply["status"] != "ok":
        raise RuntimeError(ran.error_text())
    return seconds


def save_load_floor(kernel: Kernel) -> float:
    """torch.save + torch.load of the captured tensor through /dev/shm, in the notebook's process."""
    ran = kernel.execute(SAVE_LOAD)
    return float(ran.stream("stdout").split("floor ")[1])


def row(name: str, values: list[float], unit: str, target: str) -> str:
    median = statistics.median(values)
    number = f"{median:.3f}{unit}"
    spread = f"({min(values):.3f}, {max(values):.3f})"
    return f"| {name} | {number} | {spread} | {len(values)} | {target} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=5)
    parser.add_argument("--warm", type=int, default=3, help="warm cells per kernel")
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--cold-only", action="store_true", help="only the floor and the cold cell, per kernel")
    parser.add_argument("--kernel", choices=("taas", "python3"), default="taas",
                        help="taas: the kernel Python 3 (taas), which loads the extension as it starts, and the "
                             "cold cell the moment it answers; python3: a plain kernel, `%%load_ext taas_magic`, "
                             "then the cold cell the moment that replies")
    args = parser.parse_args()
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.kernels):
            floor = floor_seconds()
            kernel = Kernel(args.kernel, load_ext=args.kernel == "python3", cwd=tmp)
            try:
                add("floor: two parallel `import torch`", floor)
                cold = first_line(kernel, DDP_CELL)
                add("cold: a fresh kernel's first DDP cell", cold)
                add("cold / its floor (paired)", cold / floor)
                if args.cold_only:
                    continue
                for cell, name in ((DDP_CELL, "warm: a DDP cell 5 s after the last"),
                                   (DDP_INIT_CELL, "warm, its line after init_process_group")):
                    for _ in range(args.warm):
                        wait_for_spares(kernel, 2)
                        time.sleep(PAUSE)
                        add(name, first_line(kernel, cell))
                kernel.execute(f"import torch\ncapture = torch.randn({args.megabytes} * 2**18)")  # float32
                floor = save_load_floor(kernel)
                wait_for_spares(kernel, 2)
                time.sleep(PAUSE)
                capture = first_line(kernel, CAPTURE_CELL)
                add(f"floor: torch.save + load of {args.megabytes} MB via /dev/shm", floor)
                add(f"capture {args.megabytes} MB: first line", capture)
                add(f"capture {args.megabytes} MB / its floor (paired)", capture / floor)
            finally:
                kernel.shutdown()
    targets = {
        "cold / its floor (paired)": "target <= 0.95x",
        "warm: a DDP cell 5 s after the last": "target <= 0.040 s",
        f"capture {args.megabytes} MB / its floor (paired)": "target <= 1.20x",
    }
    print(f"\nbench/start.py: --device cpu --gpus 2 (gloo), {os.cpu_count()} cores, {args.kernels} fresh kernels "
          f"(--kernel {args.kernel})")
    print("| figure | median | (min, max) | samples | target |")
    print("|---|---|---|---|---|")
    for name, values in rows.items():
        unit = "x" if name.endswith("(paired)") else " s"
        print(row(name, values, unit, targets.get(name, "")))


if __name__ == "__main__":
    main()
