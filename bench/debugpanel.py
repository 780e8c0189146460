"""JupyterLab's debugger panel on the ranks: what a cell pays with the panel off, and with it on.

    python bench/debugpanel.py [--repeats 5] [--steps 300000]

Two real kernels (the tests' client; the panel's own messages on the control channel, tests/panelled.py). The cell
is a Python-bound loop (``--steps`` iterations of integer arithmetic, a small tensor op every thousandth), timed
inside each rank with ``time.perf_counter`` around the loop only (start-up is not the panel's). In one run, each
repeat one of each, in turn:

- never: a 2-rank CPU taas cell in a kernel whose panel was never opened: the floor;
- off: the same cell in a second kernel whose panel was opened (initialize, attach) and closed (disconnect) again:
  the figure the target is about (nothing measurable: within 2% of never, paired);
- on: the same cell in that kernel with the panel open and a breakpoint in the cell on a line the loop never
  reaches: each rank runs the cell under taas's ``bdb`` tracer (line events in the cell's frame: the worst case of
  the panel on without a stop);
- debugpy: the same loop in a plain cell of that kernel, panel open, its breakpoint on a line never reached:
  ipykernel's own debugger, what a person has for one process.

Each figure is the median over repeats of the slower rank's loop time, with (min, max); ratios are per repeat
(paired: the same repeat's cells ran back to back), then their median.
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
from tests.panelled import breakpoint_in, closed, opened  # noqa: E402

LOOP = """import time, torch
x = torch.zeros(8)
began = time.perf_counter()
total = 0
for i in range({steps}):
    total += i % 7
    if i % 1000 == 0:
        x += 1
if total < 0:
    print("never")
print(f"loop {{time.perf_counter() - began!r}}")
"""
NEVER_LINE = 10  # print("never"): the loop never reaches it
TAAS = "#pragma taas --device cpu --gpus 2 --output all\n"


def timed(kernel: Kernel, code: str) -> float:
    """The slowest rank's (or the plain cell's) loop time."""
    ran = kernel.execute(code, timeout=600)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    return max(float(found) for found in re.findall(r"loop ([0-9.e-]+)", ran.stream("stdout")))


def row(name: str, values: list[float], target: str, beside: str) -> str:
    return (f"{name:<40} {statistics.median(values):8.3f} s ({min(values):.3f}, {max(values):.3f})  "
            f"{target:<24} {beside}")


def ratio_row(name: str, tops: list[float], bottoms: list[float], target: str) -> str:
    ratios = [top / bottom for top, bottom in zip(tops, bottoms)]
    return (f"{name:<40} {statistics.median(ratios):8.3f}x ({min(ratios):.3f}, {max(ratios):.3f})  {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300_000)
    args = parser.parse_args()
    plain = LOOP.format(steps=args.steps)
    cell = TAAS + plain
    never, toggled = Kernel(), Kernel()
    figures: dict[str, list[float]] = {"never": [], "off": [], "on": [], "debugpy": []}
    try:
        for kernel in (never, toggled):
            kernel.execute("%load_ext taas_magic")
            timed(kernel, cell)  # warms the spares: not timed
        for _ in range(args.repeats):
            figures["never"].append(timed(never, cell))
            closed(opened(toggled))
            figures["off"].append(timed(toggled, cell))
            panel = opened(toggled)
            breakpoint_in(panel, cell, NEVER_LINE + 1)  # the pragma line shifts the cell's lines by one
            figures["on"].append(timed(toggled, cell))
            breakpoint_in(panel, plain, NEVER_LINE)
            figures["debugpy"].append(timed(toggled, plain))
            closed(panel)
    finally:
        never.shutdown()
        toggled.shutdown()
    print(f"\n{args.repeats} repeats, a loop of {args.steps} steps; medians (min, max) of the slower rank's loop time\n")
    print(f"{'':<40} {'median':>10} {'(min, max)':>16}  {'target':<24} beside")
    print(row("taas cell, panel never opened", figures["never"], "the floor", ""))
    print(row("taas cell, panel opened and closed", figures["off"], "", ""))
    print(row("taas cell, panel on, breakpoint not hit", figures["on"], "", ""))
    print(row("plain cell, debugpy on, breakpoint not hit", figures["debugpy"], "", "ipykernel's own"))
    print(ratio_row("panel off / never (paired)", figures["off"], figures["never"], "<= 1.02x"))
    print(ratio_row("panel on / never (paired)", figures["on"], figures["never"], "(what the panel on costs)"))
    print(ratio_row("panel on / debugpy on (paired)", figures["on"], figures["debugpy"], "(beside ipykernel's)"))


if __name__ == "__main__":
    main()
