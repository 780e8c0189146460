"""Rank-0 output through a real kernel: latency when it is slow, cost and message rate when it floods.

    python bench/stream.py [--repeats 5] [--lines 200000]

Side by side, in one run, through one kernel (jupyter_client, as a notebook sees it):

- latency: rank 0 prints its clock and flushes, 20 lines 0.1 s apart; latency is the
  iopub arrival time minus the printed time (same host clock): p50, p90, p99, max;
- flood: rank 0 prints --lines lines in a tight loop, timed inside the rank, once to the
  cell and once to a file (``print(..., file=f)``); the slowdown is the ratio of the
  medians. Also: stream messages per second on iopub during the flood (Jupyter's default
  iopub limit is 1000 messages/s), and the bytes that reached the cell.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

from launch import flushed_line_latencies  # noqa: E402  the same 20 flushed lines as bench/launch.py

from tests.kernel_client import Kernel  # noqa: E402

FLOOD_CELL = """#pragma taas --gpus 2
import sys, time
target = {target}
started = time.perf_counter()
for i in range({lines}):
    print("line", i, "of the flood", file=target)
target.flush()
print(f"flood-seconds {{time.perf_counter() - started:.6f}}", flush=True)
del target  # a stream would come back to the notebook by reference
"""


def flood(kernel: Kernel, lines: int, to_file: bool) -> tuple[float, float, int]:
    """(seconds in the rank, stream messages per second, characters shown in the cell)."""
    target = "open(__import__('tempfile').mkstemp()[1], 'w')" if to_file else "sys.stdout"
    ran = kernel.execute(FLOOD_CELL.format(target=target, lines=lines), timeout=600)
    assert ran.reply["status"] == "ok", ran.error_text()
    seconds = float(re.search(r"flood-seconds (\S+)", ran.stream("stdout")).group(1))
    streams = ran.of_type("stream")
    span = max(streams[-1].at - streams[0].at, 1e-3)
    return seconds, len(streams) / span, len(ran.stream())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lines", type=int, default=200_000)
    args = parser.parse_args()
    kernel = Kernel()
    try:
        kernel.execute("#pragma taas --gpus 2\npass")  # the first cell pays the write-rule probe
        late = flushed_line_latencies(kernel)
        to_cell, to_file, rates, shown = [], [], [], []
        for _ in range(args.repeats):  # alternating, so drift hits both alike
            seconds, rate, chars = flood(kernel, args.lines, to_file=False)
            to_cell.append(seconds)
            rates.append(rate)
            shown.append(chars)
            to_file.append(flood(kernel, args.lines, to_file=True)[0])
    finally:
        kernel.shutdown()
    print(f"flushed line -> iopub, {len(late)} lines: p50 {percentile(late, 0.5) * 1e3:.1f} ms, "
          f"p90 {percentile(late, 0.9) * 1e3:.1f} ms, p99 {percentile(late, 0.99) * 1e3:.1f} ms, "
          f"max {max(late) * 1e3:.1f} ms (target < 200 ms)")
    cell, file = statistics.median(to_cell), statistics.median(to_file)
    print(f"{args.lines} lines in a tight loop, rank 0, medians of {args.repeats}:")
    print(f"  to the cell {cell:.3f} s, to a file {file:.3f} s: slowdown {cell / file - 1:+.1%} (target < 5%)")
    print(f"  iopub stream messages: {statistics.median(rates):.0f}/s median, {max(rates):.0f}/s max "
          f"(about 50/s intended; Jupyter's limit is 1000/s)")
    print(f"  characters shown in the cell: {statistics.median(shown):,.0f} (head and tail; the rest in the log)")


if __name__ == "__main__":
    main()
