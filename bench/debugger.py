"""A rank's pdb prompt in the cell, timed beside IPython's own pdb in the same kernel.

    python bench/debugger.py [--repeats 10] [--commands 10]

One real kernel (the tests' client, answering ``input_request`` as a notebook's input box does).
In one run, alternating:

- taas: a 2-rank CPU cell whose rank 1 notes ``time.time()`` and calls ``breakpoint()``. First
  prompt: from that moment to the ``input_request`` reaching the client (target 1 s). Command:
  from sending ``p x`` to the next ``input_request`` (pdb's answer and the next prompt on the
  page; target 0.1 s), ``--commands`` times a session.
- IPython: the same in a plain cell of the same kernel, IPython's own debugger
  (``IPython.core.debugger.set_trace()``: ipdb through the same stdin channel; a plain
  ``breakpoint()`` in an ipykernel 7 cell goes to debugpy, which does nothing unless a frontend's
  debugger is attached): what a person has for one process. The taas prompt's extra path is the
  rank's channel to the kernel and back.

Medians of every measurement, with (min, max); ratios are of medians measured in this run.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.kernel_client import Kernel, Session, debug  # noqa: E402

TAAS = ("#pragma taas --device cpu --gpus 2 --output all\nimport os, time\nx = 41 + int(os.environ['RANK'])\n"
        "if os.environ['RANK'] == '1':\n    print(f'reached {time.time()!r}', flush=True)\n    breakpoint()\n    x += 1\n")
PLAIN = ("import time\nfrom IPython.core.debugger import set_trace\nx = 42\n"
         "print(f'reached {time.time()!r}', flush=True)\nset_trace()\nx += 1\n")


def session(kernel: Kernel, code: str, commands: int) -> tuple[float, list[float]]:
    """The first prompt's delay after the breakpoint, and each command's answer time."""
    answers = ["p x"] * commands + ["c"]
    ran: Session = debug(kernel, code, answers)
    assert ran.error is None and len(ran.prompts) == commands + 1, (ran.error, ran.prompts)
    reached = float(re.search(r"reached ([0-9.]+)", ran.text + "".join(ran.texts)).group(1))
    return ran.asked_at[0] - reached, ran.waits[:commands]


def row(name: str, values: list[float], floor: str, beside: str) -> str:
    return (f"{name:<34} {statistics.median(values) * 1000:8.1f} ms ({min(values) * 1000:.1f}, {max(values) * 1000:.1f})"
            f"  {floor:<22} {beside}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--commands", type=int, default=10)
    args = parser.parse_args()
    kernel = Kernel()
    first: dict[str, list[float]] = {"taas": [], "ipython": []}
    command: dict[str, list[float]] = {"taas": [], "ipython": []}
    try:
        session(kernel, TAAS, 1)  # the first run warms the spares: not timed
        for _ in range(args.repeats):
            for name, code in (("taas", TAAS), ("ipython", PLAIN)):
                delay, waits = session(kernel, code, args.commands)
                first[name].append(delay)
                command[name].extend(waits)
    finally:
        kernel.shutdown()
    print(f"\n{args.repeats} sessions each, {args.commands} commands a session, medians (min, max)\n")
    print(f"{'':<34} {'median':>11} {'(min, max)':>15}  {'target':<22} beside")
    ratio = statistics.median(first["taas"]) / statistics.median(first["ipython"])
    print(row("taas: breakpoint -> first prompt", first["taas"], "1 s",
              f"IPython's own: {statistics.median(first['ipython']) * 1000:.1f} ms ({ratio:.1f}x)"))
    print(row("IPython pdb, same kernel", first["ipython"], "", ""))
    ratio = statistics.median(command["taas"]) / statistics.median(command["ipython"])
    print(row("taas: p x -> next prompt", command["taas"], "0.1 s",
              f"IPython's own: {statistics.median(command['ipython']) * 1000:.1f} ms ({ratio:.1f}x)"))
    print(row("IPython pdb, same kernel", command["ipython"], "", ""))


if __name__ == "__main__":
    main()
