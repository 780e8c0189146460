"""Kept ranks (``--keep``), beside fresh ranks: what a cell costs when the ranks are already there.

    python bench/keep.py [--runs 5]

Through a real kernel (jupyter_client), ``--device cpu --gpus 2`` (gloo), each row measured ``--runs`` times
(median, min, max), kept ranks beside fresh warm ranks (the same cell without ``--keep``, its warm spares
ready) in the same kernel, one after the other, so a busy moment moves both:

- first line: the execute request -> rank 0's first line on iopub, the ranks idle 2 s before; target for
  the kept cell: at most 0.020 s;
- all_reduce: the request -> the reply of a cell that all-reduces one tensor (``init_process_group`` in it:
  harmless on kept ranks, paid again by fresh ones);
- failed collective: the request of a cell where rank 1 raises while rank 0 waits in ``all_reduce`` -> its
  error reply, then -> the reply of the next working ``--keep`` cell (new ranks start: the kept ones were
  stopped); target: the next working cell within 5 s of the error;
- interrupt: the kernel's interrupt of a kept cell looping in Python -> its reply (every rank stopped its
  cell, and the ranks are kept); target: at most 3 s;
- compiled: a ``torch.compile``'d function's first call in kept ranks (compiling), and its call in the next
  kept cell (not compiled again); target: the second at most 5% of the first.

Beside them, ``--nbdistributed SITE`` (a folder holding ``pip install --no-deps --target SITE nbdistributed``)
measures nbdistributed's kept workers on the first two rows, in a kernel of its own: ``%dist_init -n 2``, then
the same cells (its workers made their gloo group at ``%dist_init``). Its recovery rows are not run: its
only way out of a failed collective is ``%dist_shutdown``, whose ``pkill -f`` on name patterns (``worker.py``,
``python.*worker``, ``torch.*distributed``) ends other processes of this machine too; its kernel is ended here
by killing that kernel's own process tree. jupyter-distributed needs a Jupyter server and its proxy kernel:
not measured yet (docs/limits.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.kernel_client import Kernel  # noqa: E402

KEEP = "#pragma taas --gpus 2 --device cpu --keep\n"
FRESH = "#pragma taas --gpus 2 --device cpu\n"
FIRST = "print('first-line', flush=True)\n"
ALL_REDUCE = ("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
              "dist.all_reduce(torch.ones(1))\ndist.destroy_process_group()\n")
FAILING = ("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
           "if dist.get_rank() == 1:\n    raise RuntimeError('rank 1 gave up')\ndist.all_reduce(torch.ones(1))\n")
LOOP = "import time\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.01)\n"
COMPILED = ("import time, torch\nif 'step' not in globals():\n"
            "    step = torch.compile(lambda x: torch.sin(x) * 2 + x.cos())\n"
            "x = torch.randn(64)\nstarted = time.perf_counter()\nstep(x)\nprint(f'call {time.perf_counter() - started:.4f}')\n")


def reply(kernel: Kernel, code: str, expect: str = "ok") -> float:
    msg_id, started = kernel.submit(code)
    ran = kernel.collect(msg_id, started, timeout=300)
    if ran.reply["status"] != expect:
        raise RuntimeError(f"expected {expect}: {ran.error_text() or ran.stream()}")
    return ran.reply_at


def first_line(kernel: Kernel, code: str) -> float:
    msg_id, started = kernel.submit(code)
    kernel.wait_for_stream(msg_id, "first-line", timeout=120)
    seconds = time.monotonic() - started
    kernel.collect(msg_id, started, timeout=120)
    return seconds


def interrupt(kernel: Kernel) -> float:
    msg_id, started = kernel.submit(KEEP + LOOP)
    kernel.wait_for_stream(msg_id, "looping", timeout=120)
    asked = time.monotonic()
    kernel.manager.interrupt_kernel()
    ran = kernel.collect(msg_id, started, timeout=120)
    if "the ranks are kept" not in ran.stream():
        raise RuntimeError(f"the interrupt did not keep the ranks: {ran.stream()}")
    return time.monotonic() - asked


def compiled(kernel: Kernel) -> tuple[float, float]:
    kernel.execute("%taas release")
    calls = []
    for _ in range(2):
        ran = kernel.execute(KEEP + COMPILED, timeout=600)
        calls.append(float(ran.stream().split("call ")[1].split()[0]))
    return calls[0], calls[1]


def nbdistributed(site: str, runs: int) -> tuple[list[float], list[float]]:
    """nbdistributed's first line and all_reduce cell, ``runs`` times each (see the module docstring)."""
    import psutil

    # it starts its workers as "python" from PATH: this interpreter's, as in an activated venv
    path = os.pathsep.join((os.path.dirname(sys.executable), os.environ.get("PATH", "")))
    kernel = Kernel(load_ext=False, env={"PYTHONPATH": site, "PATH": path})
    tree = psutil.Process(kernel.pid)
    try:
        for setup in ("%load_ext nbdistributed", "%dist_init -n 2"):
            ran = kernel.execute(setup, timeout=300)
            if ran.reply["status"] != "ok":
                raise RuntimeError(f"{setup}: {ran.error_text() or ran.stream()}")
        reply(kernel, "import torch, torch.distributed as dist\n")
        first, reduce = [], []
        for _ in range(runs):
            time.sleep(2)
            first.append(first_line(kernel, FIRST))
            reduce.append(reply(kernel, "dist.all_reduce(torch.ones(1))\n"))
        return first, reduce
    finally:
        processes = tree.children(recursive=True)
        kernel.shutdown()
        for process in processes:
            try:
                process.kill()
            except psutil.Error:
                pass


def row(name: str, values: list[float], beside: list[float] | None, target: str, unit: str = "s") -> str:
    def shown(samples: list[float]) -> str:
        return f"{statistics.median(samples):.3f} {unit} ({min(samples):.3f}-{max(samples):.3f})"

    other = shown(beside) if beside else ""
    return f"| {name} | {shown(values)} | {other} | {target} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--nbdistributed", metavar="SITE", help="a folder holding nbdistributed (see above)")
    arguments = parser.parse_args()
    runs = arguments.runs
    kernel = Kernel()
    try:
        rows: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in ("first", "reduce", "failed", "next")}
        interrupts: list[float] = []
        reply(kernel, KEEP + "pass\n")
        reply(kernel, FRESH + "pass\n")
        for _ in range(runs):
            time.sleep(2)
            rows["first"][0].append(first_line(kernel, KEEP + FIRST))
            time.sleep(2)
            rows["first"][1].append(first_line(kernel, FRESH + FIRST))
            rows["reduce"][0].append(reply(kernel, KEEP + ALL_REDUCE))
            time.sleep(2)
            rows["reduce"][1].append(reply(kernel, FRESH + ALL_REDUCE))
            rows["failed"][0].append(reply(kernel, KEEP + FAILING, expect="error"))
            rows["next"][0].append(reply(kernel, KEEP + "pass\n"))
            interrupts.append(interrupt(kernel))
        first_call, second_call = compiled(kernel)
        kernel.execute("%taas release")
    finally:
        kernel.shutdown()
    other = nbdistributed(arguments.nbdistributed, runs) if arguments.nbdistributed else None
    print(f"kept ranks beside fresh warm ranks, 2 CPU ranks (gloo), {runs} runs each: median (min-max)\n")
    print("| row | kept | fresh (warm spares) | target |")
    print("| --- | --- | --- | --- |")
    print(row("first line", *rows["first"], "kept <= 0.020 s"))
    print(row("a cell with an all_reduce, to its reply", *rows["reduce"], ""))
    print(row("failed collective: request to the error", rows["failed"][0], None, ""))
    print(row("failed collective: the error to the next working cell", rows["next"][0], None, "<= 5 s"))
    print(row("interrupt: the interrupt to the reply, ranks kept", interrupts, None, "<= 3 s"))
    ratio = second_call / first_call
    print(f"| compiled: first call (compiling) / next call in kept ranks | {first_call:.3f} s / {second_call:.4f} s "
          f"= {ratio:.1%} | | <= 5% |")
    if other is not None:
        print("\nnbdistributed's kept workers (%dist_init -n 2), the same cells\n")
        print("| row | nbdistributed | taas kept (above) |")
        print("| --- | --- | --- |")
        for name, theirs, ours in (("first line", other[0], rows["first"][0]),
                                   ("a cell with an all_reduce, to its reply", other[1], rows["reduce"][0])):
            print(row(name, theirs, ours, "").rsplit(" |  |", 1)[0] + " |")


if __name__ == "__main__":
    main()
