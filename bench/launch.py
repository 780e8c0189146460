"""Launch latency and training throughput of a taas cell, beside its floor and torchrun.

    python bench/launch.py [--repeats 5] [--steps 1000]

Everything is measured in one run, side by side, through a real kernel driven by
jupyter_client (the time a person waits: execute_request -> first rank-0 line on iopub):

- floor: two ``python -c "import torch"`` started in parallel, until both have imported
  torch (what any fresh-process launcher of 2 torch ranks must pay at least);
- taas, first cell: the first taas cell of a freshly started kernel (extension loaded);
- taas, warm cell: a following cell in the same kernel, once the warm spares the first
  cell left are ready (and the whole of a 50-step cell, the anchors' workload);
- torchrun: the same DDP loop as a script under ``python -m torch.distributed.run``;
- the anchors of ``bench/anchors.py`` that are installed (accelerate's notebook_launcher,
  Lightning's ddp_notebook, ipyparallel's %%px on a running cluster), 50 steps each;
- steps/s: steady-state DDP steps per second of the same loop (2 ranks, gloo, a small
  MLP), under taas and under torchrun: over the timed steps' total time, and from the
  median step (which a moment of contention on a shared host does not move);
- isolation cost: a 2-rank cell whose ranks print their clock first thing; rank 1 runs
  under the write rule's isolation, rank 0 never does, so rank 1's start minus rank 0's
  start is what the isolation adds (overlay and Python modes, one kernel);
- flushed-line latency: rank 0 prints its clock and flushes, 20 times, 0.1 s apart; the
  latency is the iopub arrival time (same host clock) minus the printed time;
- capture size vs start: time to the first rank-0 line of a cell that captures 0, 50 or
  200 MB of tensors, with the closure in one shared file (the default above 4 MB) and,
  beside it, sent through each rank's socket.

Medians of --repeats runs; ratios are of medians measured in this run.

``--cluster`` times the cluster mode (``--gpus 4`` on a local multi-node Ray cluster)
beside Ray Train's TorchTrainer instead: see bench/cluster.py.

``--next-cell`` measures what a person who reruns a cell meets, in --repeats fresh kernels:
the first cell's first line (cold), a cell sent 1 s after the last one's reply (its spares
are forks of the spare factory once it has imported torch, else still importing: the cell
takes them and waits), one sent once the spares are ready, and one sent the moment that
one replied; target: the 1 s cell at most 0.6x the cold one.

``--throughput-only`` measures steps/s alone, in --repeats pairs of a taas cell (one kernel)
and a torchrun run, in ABBA order, with the spares a taas cell refills ready before torchrun
starts, and prints the median of the paired ratios: on a noisy 2-core machine that is a
fairer comparison than two medians taken minutes apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import anchors  # noqa: E402
from tests.kernel_client import Kernel  # noqa: E402

LOOP = (
    "import os, time, torch, torch.distributed as dist\n"
    'print("first-line", flush=True)\n'
    'dist.init_process_group("gloo", init_method="env://")\n'
    + anchors.MODEL
    + "WARM, STEPS, took = 20, {steps}, []\n"
    "for i in range(WARM + STEPS):\n"
    "    t0 = time.perf_counter()\n"
    + anchors.STEP
    + "    took.append(time.perf_counter() - t0)\n"
    "took = sorted(took[WARM:])\n"
    "if dist.get_rank() == 0:\n"
    '    print(f"steps_per_sec {{STEPS / sum(took):.2f}} median_step_per_sec {{1 / took[STEPS // 2]:.2f}}", flush=True)\n'
    "dist.destroy_process_group()\n"
)


class Rates(NamedTuple):
    """Steps/s of the loop's timed steps: over their total time, and from the median step
    (which a moment of host contention on a shared machine does not move)."""

    mean: float
    median: float

    @classmethod
    def parse(cls, output: str) -> "Rates":
        words = output.split("steps_per_sec ")[1].split()
        return cls(float(words[0]), float(words[2]))


def floor_seconds() -> float:
    """Until both of two parallel ``python -c "import torch"`` have imported it (exit not counted)."""
    started = time.monotonic()
    code = "import torch; print('imported', flush=True)"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        proc.stdout.readline()  # type: ignore[union-attr]
    imported = time.monotonic() - started
    for proc in procs:
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    return imported


def taas_cell(kernel: Kernel, steps: int) -> tuple[float, float, float]:
    """(first rank-0 line, whole cell, steps/s) of one taas cell."""
    msg_id, started = kernel.submit("#pragma taas --device cpu --gpus 2\n" + LOOP.format(steps=steps))
    ran = kernel.collect(msg_id, started, timeout=600)
    if ran.reply["status"] != "ok":
        raise RuntimeError(ran.error_text())
    first = next(m.at for m in ran.messages if m.type == "stream" and "first-line" in m.content["text"])
    return first, ran.reply_at, Rates.parse(ran.stream("stdout"))


ANCHOR_STEPS = anchors.STEPS  # the workload the anchors (fork launchers, ipyparallel, Ray) run
WARM_50 = f"taas warm cell, {ANCHOR_STEPS} steps: whole"


def wait_for_spares(kernel: Kernel, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sum(p.name() == "taas-spare" for p in kernel.spares()) < count:
        time.sleep(0.05)


LATENCY_CELL = """#pragma taas --device cpu --gpus 2
import time
for _ in range(20):
    print(f"stamp {time.time():.6f}", flush=True)
    time.sleep(0.1)
"""


def flushed_line_latencies(kernel: Kernel) -> list[float]:
    msg_id = kernel.client.execute(LATENCY_CELL)
    latencies = []
    while True:
        msg = kernel.client.get_iopub_msg(timeout=120)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        arrived = time.time()
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return latencies
        if msg["msg_type"] == "stream":
            latencies += [arrived - float(line.split()[1]) for line in msg["content"]["text"].splitlines() if line.startswith("stamp ")]


START_CELL = """#pragma taas --device cpu --gpus 2 --output all
import time
print(f"start {time.time():.6f}", flush=True)
"""


def isolation_costs(kernel: Kernel, repeats: int) -> dict[str, list[float]]:
    costs: dict[str, list[float]] = {}
    for mode in ("overlay", "python"):
        kernel.execute(f"%taas config isolation {mode}")
        for _ in range(repeats):
            ran = kernel.execute(START_CELL)
            stamps = {
                line.split("]")[0]: float(line.split("start ")[1])
                for line in ran.stream("stdout").splitlines() if "start " in line
            }
            costs.setdefault(f"isolation cost ({mode})", []).append(stamps["[rank 1"] - stamps["[rank 0"])
    kernel.execute("%taas config isolation auto")
    return costs


def torchrun(script: Path) -> tuple[float, float, float]:
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    first = None
    out = []
    for line in proc.stdout:  # type: ignore[union-attr]
        if first is None and "first-line" in line:
            first = time.monotonic() - started
        out.append(line)
    proc.wait()
    whole = time.monotonic() - started
    return first or whole, whole, Rates.parse("".join(out))


NEXT_CELL_PAUSE = 1.0  # seconds between a cell's reply and the next cell: a person fixing a typo


def next_cell(repeats: int) -> None:
    """Cold first cell, a cell 1 s after the last (spares still warming, or forked by the factory once
    it has imported), a cell on ready spares, and one sent the moment that one replied."""
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            kernel = Kernel(cwd=tmp)
            try:
                rows.setdefault("first cell (cold)", []).append(taas_cell(kernel, ANCHOR_STEPS)[0])
                time.sleep(NEXT_CELL_PAUSE)
                rows.setdefault("next cell, 1 s later", []).append(taas_cell(kernel, ANCHOR_STEPS)[0])
                rows.setdefault("paired ratio 1 s / cold", []).append(rows["next cell, 1 s later"][-1]
                                                                      / rows["first cell (cold)"][-1])
                wait_for_spares(kernel, 2)
                rows.setdefault("next cell, spares ready", []).append(taas_cell(kernel, ANCHOR_STEPS)[0])
                rows.setdefault("next cell, at once", []).append(taas_cell(kernel, ANCHOR_STEPS)[0])
            finally:
                kernel.shutdown()
    cold = statistics.median(rows["first cell (cold)"])
    print(f"\nbench/launch.py --next-cell: rank 0's first line, --gpus 2 gloo on CPU, {os.cpu_count()} cores, "
          f"{repeats} fresh kernels")
    print(f"{'measure':<26} {'median':>9} {'min':>9} {'max':>9}  vs")
    for name, values in rows.items():
        if name.startswith("paired"):
            print(f"{name:<26} {statistics.median(values):>8.2f}x {min(values):>8.2f} {max(values):>8.2f}  target <= 0.60x")
            continue
        versus = "" if name.startswith("first") else f"{statistics.median(values) / cold:.2f}x cold"
        print(f"{name:<26} {statistics.median(values):>8.3f}s {min(values):>8.3f} {max(values):>8.3f}  {versus}")


def paired_throughput(repeats: int, steps: int) -> None:
    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "loop.py"
        script.write_text(LOOP.format(steps=steps))
        kernel = Kernel(cwd=tmp)
        try:
            taas_cell(kernel, 50)  # let the kernel settle; not counted

            def taas_rates() -> Rates:
                rates = taas_cell(kernel, steps)[2]
                wait_for_spares(kernel, 2)  # the spares it refills import torch: not during torchrun
                return rates

            for pair in range(repeats):
                # ABBA order, so neither side always runs first (drift, a machine warming up)
                if pair % 2 == 0:
                    taas, other = taas_rates(), torchrun(script)[2]
                else:
                    other, taas = torchrun(script)[2], taas_rates()
                for kind in Rates._fields:
                    ours, theirs = getattr(taas, kind), getattr(other, kind)
                    rows.setdefault(f"taas steps/s ({kind})", []).append(ours)
                    rows.setdefault(f"torchrun steps/s ({kind})", []).append(theirs)
                    rows.setdefault(f"paired ratio ({kind})", []).append(ours / theirs)
        finally:
            kernel.shutdown()
    print(f"\nbench/launch.py --throughput-only: {repeats} pairs (ABBA order), {steps} steps, --gpus 2 gloo on CPU")
    print(f"{'measure':<30} {'median':>9} {'min':>9} {'max':>9}")
    for name in sorted(rows, key=lambda name: (name.split("(")[1], name)):
        values = rows[name]
        print(f"{name:<30} {statistics.median(values):>9.3f} {min(values):>9.3f} {max(values):>9.3f}")


CAPTURE_CELL = """#pragma taas --device cpu --gpus 2
print("first-line", capture.numel(), flush=True)
"""
CAPTURE_MB = (0, 50, 200)


def closure_start_times(kernel: Kernel) -> dict[str, float]:
    """Time to rank 0's first line for a cell capturing 0/50/200 MB of tensors, through the
    shared closure file (the default) and, for comparison, through each rank's socket."""
    times = {}
    for megabytes in CAPTURE_MB:
        kernel.execute(f"import torch\ncapture = torch.randn({megabytes} * 2**18)")  # float32: 4 bytes each
        for transport, threshold in (("file", None), ("socket", 1 << 40)):
            if threshold is not None:
                kernel.execute(f"%config TaasMagics.closure_file_bytes = {threshold}")
            wait_for_spares(kernel, 2)  # both transports from warm spares: only the closure differs
            msg_id, started = kernel.submit(CAPTURE_CELL)
            kernel.wait_for_stream(msg_id, "first-line")
            times[f"capture {megabytes:>3} MB, {transport}: first line"] = time.monotonic() - started
            kernel.collect(msg_id, started)
            kernel.execute("%config TaasMagics.closure_file_bytes = 4 << 20")
    kernel.execute("del capture")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--throughput-only", action="store_true")
    parser.add_argument("--next-cell", action="store_true", help="cold, 1 s later and warm first lines only")
    parser.add_argument("--cluster", action="store_true", help="the cluster mode beside Ray Train (bench/cluster.py)")
    args = parser.parse_args()
    if args.cluster:
        from bench import cluster

        cluster.run(args.repeats)
        return
    if args.throughput_only:
        paired_throughput(args.repeats, args.steps)
        return
    if args.next_cell:
        next_cell(args.repeats)
        return

    results: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)

    def add_rates(who: str, rates: Rates) -> None:
        add(f"{who} steps/s", rates.mean)
        add(f"{who} steps/s (median step)", rates.median)

    anchor_runs = anchors.available()
    anchor_failures: dict[str, list[str]] = {}  # anchor -> why each failed run has no figures
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "loop.py"
        script.write_text(LOOP.format(steps=args.steps))
        for _ in range(args.repeats):
            add("floor", floor_seconds())
            kernel = Kernel(cwd=tmp)
            try:
                first, whole, rates = taas_cell(kernel, args.steps)
                add("taas first cell: first line", first)
                add("taas first cell: whole cell", whole)
                add_rates("taas", rates)
                wait_for_spares(kernel, 2)  # what a person's next cell finds, seconds later
                first, whole, rates = taas_cell(kernel, args.steps)
                add("taas warm cell: first line", first)
                add("taas warm cell: whole cell", whole)
                add_rates("taas", rates)
                for _ in range(3):  # the closest race: three samples per kernel
                    wait_for_spares(kernel, 2)
                    first, whole, _ = taas_cell(kernel, ANCHOR_STEPS)
                    add(WARM_50, whole)
                time.sleep(NEXT_CELL_PAUSE)  # a rerun 1 s later: its spares are still warming
                add("taas cell 1 s after the last: first line", taas_cell(kernel, ANCHOR_STEPS)[0])
                for latency in flushed_line_latencies(kernel):
                    add("flushed line -> iopub", latency)
                for name, values in isolation_costs(kernel, 3).items():
                    for value in values:
                        add(name, value)
                for name, value in closure_start_times(kernel).items():
                    add(name, value)
            finally:
                kernel.shutdown()
            first, whole, rates = torchrun(script)
            add("torchrun: first line", first)
            add("torchrun: whole", whole)
            add_rates("torchrun", rates)
            for name, run in anchor_runs.items():
                outcome = anchors.run_with_deadline(name, run, tmp)
                if isinstance(outcome, str):
                    anchor_failures.setdefault(name, []).append(outcome)
                    continue
                add(f"{name}: first line", outcome[0])
                add(f"{name}: whole", outcome[1])

    med = {name: statistics.median(values) for name, values in results.items()}
    floor = med["floor"]
    print(f"\nbench/launch.py: --gpus 2 on CPU (gloo), {os.cpu_count()} cores, {args.repeats} repeats, {args.steps} steps")
    print(f"{'measure':<34} {'median':>9} {'min':>9} {'max':>9}  vs")
    for name, values in results.items():
        unit = "" if "steps/s" in name else " s"
        if name.startswith("isolation cost"):
            versus = "rank 1 (isolated) start - rank 0 start; target <= 0.050 s"
        elif name == "flushed line -> iopub":
            versus = f"p90 {statistics.quantiles(values, n=10)[-1]:.3f} s, max {max(values):.3f} s (target < 0.2 s)"
        elif "steps/s" in name:
            versus = f"{med[name] / med[name.replace('taas', 'torchrun')]:.3f}x torchrun"
        elif name.startswith("capture"):
            versus = f"{med[name] / floor:.2f}x floor (file: written once, mapped by each rank)"
        elif any(name.startswith(anchor) for anchor in anchor_runs):
            versus = (f"taas warm 50-step cell {med[WARM_50] / med[name]:.2f}x this" if name.endswith("whole")
                      else f"taas warm cell {med['taas warm cell: first line'] / med[name]:.2f}x this")
        elif name == "floor":
            versus = "2x python -c 'import torch' in parallel"
        elif name == "taas cell 1 s after the last: first line":
            versus = f"{med[name] / med['taas first cell: first line']:.2f}x the cold first cell (target <= 0.60x)"
        else:
            versus = f"{med[name] / floor:.2f}x floor"
        print(f"{name:<34} {med[name]:>8.3f}{unit[:2]:<2} {min(values):>8.3f} {max(values):>8.3f}  {versus}")
    for name, reasons in anchor_failures.items():
        runs = f"{len(reasons)} of {args.repeats} run(s)"
        print(f"{name:<34} {'-':>9} {'-':>9} {'-':>9}  no figures from {runs}: {'; '.join(sorted(set(reasons)))}")


if __name__ == "__main__":
    main()
