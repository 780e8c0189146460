"""The GPU host: launch, NCCL, CUDA tensors across the boundary, throughput, restarts, reports.

    python bench/gpu.py [--repeats 5] [--steps 100] [--settle 4] [--only launch,transfer,...]

Where torch sees no CUDA GPU it prints one line saying so and exits 0. Otherwise every taas
figure comes from real kernels driven by jupyter_client (tests/kernel_client.py), one rank
per GPU (``#pragma taas --gpus auto``), and torchrun runs the same scripts with
``--nproc-per-node`` = the GPUs (``--standalone``); each torchrun run and each floor has a
deadline, after which everything it started is killed (as bench/anchors.py runs its
anchors; the kernel's own processes, its warm spares, are left alone).

- launch (a fresh kernel per repeat): rank 0's first line, and its first NCCL all_reduce
  done (``torch.cuda.synchronize()`` after it), from the execute_request to their arrival
  on iopub: cold (the first taas cell of the kernel), then the next cell 1 s after the last
  one's reply (its spares still warming: it takes them and waits) and 30 s after (spares
  warm and bound to their GPUs). Floor: N plain processes started at once with the DDP
  environment running the same script (what any fresh-process launcher pays); torchrun:
  its rank 0's lines as they arrive on its pipe. The floor, torchrun's launch and
  torchrun's restart (below) run inside those 30 s, once the spares are warm, the kernel
  idle (a longer gap is noted).
- transfer (one kernel, warm cells): a 1 GiB CUDA result (rank 0's last line -> the names
  bound) and a 1 GiB captured CUDA tensor (the closure: execute_request -> rank 0's first
  line, and what it adds to the same cell capturing nothing, run once), against
  device-to-host plus host-to-device and against a device-to-device copy of 1 GiB measured
  in a plain process; which way it came (the cell's stderr line, or what the rank had to
  allocate); and the copies at the peak, in GPU
  memory (``torch.cuda.max_memory_allocated`` in the kernel and in rank 0, the notebook's
  own tensor counted for the closure) and in host memory (the kernel's and rank 0's
  anonymous resident pages plus /dev/shm's growth, sampled every 5 ms). Pinned host memory
  the CUDA driver maps itself does not show in resident pages.
- throughput (the same kernel): steps/s of a 12-layer ``nn.TransformerEncoder`` (d_model
  512, 8 heads, batch 32 x 256 tokens, bf16 autocast, AdamW, DDP over NCCL), --steps timed
  steps after 10 warm-up steps, in --repeats pairs of a taas cell and torchrun running the
  same script, in ABBA order; the median of the paired ratios.
- reports: inside the ranks of one cell, the same training step bare and with
  ``taas.report(step=i, loss=loss)`` every step (``loss`` a CUDA tensor), and bare and with
  ``loss.item()`` every step (what people write instead), in --repeats ABBA pairs each.
- restart: a ``--restarts 1`` cell whose last rank SIGKILLs itself (after --settle s, so
  the restart's spares are warm): its death to the next attempt's first rank-0 line on
  iopub, beside torchrun ``--max-restarts 1`` on the same script (the restarted rank 0
  prints its own clock, which favours torchrun) and the launch floor (a fresh start).

Medians of --repeats runs; every figure beside its floor and torchrun is measured in this run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpucells import SECTIONS, Figures, cuda_or_skip, run_cell  # noqa: E402
from bench.gpurounds import (  # noqa: E402
    closure_round,
    launch_round,
    report_costs,
    restart_round,
    result_round,
    throughput_pairs,
    transfer_floors,
)


def _times(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a == a and b == b and b > 0 else "-"  # nan != nan: a figure missing


def row(figures: Figures, name: str, label: str, unit: str, floor: str = "", beside: str = "") -> None:
    values = figures.values.get(name)
    if not values:
        print(f"{label:<44} {'-':>10} {'-':>8} {'-':>8}  {floor:<34} {beside}")
        return
    print(f"{label:<44} {statistics.median(values):8.3f}{unit:<2} {min(values):8.3f} {max(values):8.3f}  "
          f"{floor:<34} {beside}")


def print_launch(figures: Figures) -> None:
    m = figures.median
    for when in ("cold", "warm, 1 s after", "warm, 30 s after"):
        for what in ("first line", "all_reduce done"):
            name = f"{when}: {what}"
            floor, theirs = m(f"floor: {what}"), m(f"torchrun: {what}")
            row(figures, name, f"{name} (rank 0)", " s", f"floor {floor:.3f} s: {_times(m(name), floor)}",
                f"torchrun {theirs:.3f} s: {_times(m(name), theirs)}")
    for what in ("first line", "all_reduce done"):
        row(figures, f"floor: {what}", f"floor: {what} (N plain processes)", " s")
        row(figures, f"torchrun: {what}", f"torchrun: {what}", " s")


def print_transfer(figures: Figures, floors: dict) -> None:
    m = figures.median
    ways = floors.get("medians", {})
    host, device = ways.get("d2h+h2d", float("nan")), ways.get("d2d", float("nan"))

    def versus(name: str) -> str:
        return f"D2H+H2D {_times(m(name), host)}, D2D {_times(m(name), device)}"

    print(f"{'floors of 1 GiB (a plain process)':<44} D2H+H2D {host:.3f} s, D2D {device:.3f} s")
    way = "; ".join(sorted(set(figures.notes.get("result way", ["-"]))))
    row(figures, "result: last line -> bound", "1 GiB CUDA result: last line -> bound", " s",
        versus("result: last line -> bound"), f"came back: {way}")
    way = "; ".join(sorted(set(figures.notes.get("closure way", ["-"]))))
    row(figures, "closure: first line", "1 GiB CUDA closure: first line", " s", "",
        f"capturing nothing {m('closure: capturing nothing'):.3f} s; {way}")
    row(figures, "closure: added", "1 GiB CUDA closure: added to the first line", " s", versus("closure: added"))
    for what in ("result", "closure"):
        for where in ("GPU", "host"):
            how = ("rank 0 + kernel max_memory_allocated" if where == "GPU" else "anon RSS (kernel, rank 0) + /dev/shm")
            if what == "closure" and where == "GPU":
                how += " + the notebook's"
            row(figures, f"{what}: {where} copies", f"{what}: copies at the peak, {where}", "x", "(1 copy = 1 GiB)", how)


def print_rest(figures: Figures, sections: set[str]) -> None:
    m = figures.median
    if "throughput" in sections:
        row(figures, "taas steps/s", "transformer steps/s, taas", "", "",
            f"torchrun {m('torchrun steps/s'):.2f}: paired ratio {m('paired ratio'):.3f}x")
        row(figures, "torchrun steps/s", "transformer steps/s, torchrun", "")
        row(figures, "paired ratio", "paired ratio taas / torchrun", "x", "floor: torchrun itself, 1.00x")
    if "reports" in sections:
        row(figures, "report every step", "taas.report(loss=<CUDA>) every step", "x",
            f"bare step {m('bare step') * 1000:.2f} ms", f"loss.item() every step {m('item every step'):.3f}x")
        row(figures, "item every step", "loss.item() every step (instead)", "x")
    if "restart" in sections:
        floor, ours, theirs = m("floor: first line"), m("restart: death -> line"), m("torchrun restart: death -> line")
        row(figures, "restart: death -> line", "restart: death -> next first line", " s",
            f"fresh start {floor:.3f} s: {_times(ours, floor)}", f"torchrun {theirs:.3f} s: {_times(ours, theirs)}")
        row(figures, "torchrun restart: death -> line", "torchrun --max-restarts 1: death -> line", " s")


def print_table(figures: Figures, floors: dict, header: str, args: argparse.Namespace, gpus: int, took: float,
                sections: set[str]) -> None:
    import torch

    try:
        name = floors.get("gpu") or torch.cuda.get_device_name(0)
    except Exception as exc:  # noqa: BLE001 - the table matters more than the GPU's name
        name = f"name unknown: {type(exc).__name__}"
    print(f"\nbench/gpu.py: {gpus} GPU(s) ({name}), {os.cpu_count()} cores, torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}); medians of {args.repeats} runs (min, max); {args.steps} steps; took {took:.0f} s")
    if header:
        print(f"the taas header: {header}")
    print(f"{'figure':<44} {'median':>10} {'min':>8} {'max':>8}  {'floor':<34} beside")
    if "launch" in sections:
        print_launch(figures)
    if "transfer" in sections:
        print_transfer(figures, floors)
    print_rest(figures, sections)
    for name, reasons in figures.notes.items():
        if name not in ("result way", "closure way"):
            print(f"note: {name}: {'; '.join(sorted(set(reasons)))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100, help="timed transformer steps per run")
    parser.add_argument("--settle", type=float, default=4.0, help="seconds the restart's attempt 0 runs before the death")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma separated, of {', '.join(SECTIONS)}")
    args = parser.parse_args()
    gpus = cuda_or_skip()
    from tests.kernel_client import Kernel

    sections = set(args.only.split(","))
    figures, floors, began = Figures(), {}, time.monotonic()
    folder = Path(tempfile.mkdtemp(prefix="taas-bench-gpu-"))  # the kernels' working directory (the write rule's)
    notes = Path(tempfile.mkdtemp(prefix="taas-bench-gpu-notes-"))  # death notes: outside it, never diverted

    def attempt(section: str, run: Callable[[], Any]) -> bool:
        try:
            run()
            return True
        except Exception as exc:  # noqa: BLE001 - a section that fails is a note; the table still prints
            figures.note(f"{section} failed", f"{type(exc).__name__}: {str(exc).strip()[:300]}")
            return False

    headers: list[str] = []
    if "launch" in sections:
        for _ in range(args.repeats):
            if not attempt("launch", lambda: headers.append(launch_round(folder, notes, gpus, args.settle, figures))):
                break
    if "transfer" in sections:
        attempt("floors", lambda: floors.update(transfer_floors(args.repeats)))
    if sections & {"transfer", "throughput", "reports", "restart"}:
        kernel = Kernel(cwd=str(folder))
        try:
            plan: list[tuple[str, Callable[[], Any]]] = []
            empty: dict = {}
            for _ in range(args.repeats):
                plan += [("transfer", lambda: result_round(kernel, gpus, figures)),
                         ("transfer", lambda: closure_round(kernel, gpus, figures, empty))]
            plan.append(("throughput", lambda: throughput_pairs(kernel, folder, gpus, args.steps, args.repeats, figures)))
            plan.append(("reports", lambda: report_costs(kernel, gpus, args.steps, args.repeats, figures)))
            alone = "launch" not in sections
            plan += [("restart", lambda: restart_round(kernel, notes, gpus, args.settle, figures, alone))] * args.repeats
            failed: set[str] = set()
            if not attempt("the first cell", lambda: run_cell(kernel, "#pragma taas --gpus auto\nimport torch\nx = 1")):
                failed |= sections  # the first cell pays the imports; without it nothing here runs
            for section, run in plan:
                if section in sections and section not in failed and not attempt(section, run):
                    failed.add(section)  # one failure is reported; the same failure five times is not
        finally:
            kernel.shutdown()
    for made in (folder, notes):
        shutil.rmtree(made, ignore_errors=True)
    print_table(figures, floors, headers[0] if headers else "", args, gpus, time.monotonic() - began, sections)


if __name__ == "__main__":
    main()
