"""Kept ranks (``--keep``), beside fresh ranks: what a cell costs when the ranks are already there.

    python bench/keep.py [--runs 5]
    python bench/keep.py --paired --runs 61 --jupyter-distributed SITE

Through a real kernel (jupyter_client), ``--device cpu --gpus 2`` (gloo), each row measured ``--runs`` times (median,
min, max), kept ranks beside fresh warm ranks (the same cell without ``--keep``, its warm spares ready) in the same
kernel, one after the other, so a busy moment moves both:

- first line: the execute request -> rank 0's first line on iopub, the ranks idle 2 s before; target for the kept
  cell: at most 0.020 s;
- all_reduce: the request -> the reply of a cell that all-reduces one tensor (``init_process_group`` in it: harmless
  on kept ranks, paid again by fresh ones);
- failed collective (the kept ranks' group made by the cell before, as jupyter-distributed's is): the request of a
  cell where rank 1 raises while rank 0 waits in ``all_reduce`` -> rank 1's error shown (the cell's line saying so,
  before the others are given their time) and -> the cell's error reply; then rank 1's error shown -> the reply of the
  next working ``--keep`` cell sent the moment the failed cell ended (new ranks start: the kept ones were stopped);
  target: within 5 s;
- interrupt: the kernel's interrupt of a kept cell looping in Python -> its reply (every rank stopped its cell, and
  the ranks are kept); target: at most 3 s;
- compiled: a ``torch.compile``'d function's first call in kept ranks (compiling), and its call in the next kept cell
  (not compiled again); target: the second at most 5% of the first.
- a 1 GB model: a kept cell that builds ``nn.Linear(16384, 16384)`` (1.07 GB of float32) on each rank, to its reply,
  the kernel's resident memory after it, and a kept cell that uses it, to its reply; with the name left on rank 0
  until touched (``TaasMagics.lazy_bytes``' default) beside it copied into the notebook (``lazy_bytes = 0``); target:
  the cell that uses it costs what any kept cell does, and no copy.

Beside them, ``--nbdistributed SITE`` (a folder holding ``pip install --no-deps --target SITE nbdistributed``)
measures nbdistributed's kept workers on the first two rows, in a kernel of its own: ``%dist_init -n 2``, then the
same cells (its workers made their gloo group at ``%dist_init``). Its recovery rows are not run: its only way out of a
failed collective is ``%dist_shutdown``, whose ``pkill -f`` on name patterns (``worker.py``, ``python.*worker``,
``torch.*distributed``) ends other processes of this machine too; its kernel is ended here by killing that kernel's
own process tree. ``--jupyter-distributed SITE`` (the same, for jupyter-distributed) measures its proxy kernel over
two rank kernels (a kernel spec of this run's own runs ``python -m jupyter_distributed.kernel`` with
``JUPYTER_DISTRIBUTED_WORLD_SIZE=2``), its group made by a first cell, on the same two rows, then on the other two:
after the failed collective, rank 1's error shown (in its live display), then what a person does (its README: after a
failed collective "a group restart may be required"): the kernel's interrupt, and if the cell has not replied 10 s
later (rank 0 waits in gloo's all_reduce), Jupyter's kernel restart and the group made again, to the next working
cell; and the interrupt of a cell looping in Python. Its kernel is ended, restarts included, with its whole process
tree. Each tool's rows are taken in blocks, as taas's kept ones: nothing else starts processes meanwhile.

``--paired`` (with ``--jupyter-distributed``): only the first two rows, taas's kept ranks and jupyter-distributed's
side by side in ABBA pairs; the median of the paired ratios and its 95% interval (bench/intervals.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.intervals import median_interval  # noqa: E402
from tests.kernel_client import Kernel  # noqa: E402

KEEP = "#pragma taas --gpus 2 --device cpu --keep\n"
FRESH = "#pragma taas --gpus 2 --device cpu\n"
FIRST = "print('first-line', flush=True)\n"
ALL_REDUCE = ("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
              "dist.all_reduce(torch.ones(1))\ndist.destroy_process_group()\n")
FAILING = ("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
           "if dist.get_rank() == 1:\n    raise RuntimeError('rank 1 gave up')\ndist.all_reduce(torch.ones(1))\n")
MAKE_GROUP = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
# the same on a group made already: in jupyter-distributed's kernels a second init_process_group raises on every rank
# ("trying to initialize the default process group twice"), which fails the cell before any collective
FAILING_MADE = FAILING.replace("dist.init_process_group('gloo')\n", "")
LOOP = "import time\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.01)\n"
COMPILED = ("import time, torch\nif 'step' not in globals():\n"
            "    step = torch.compile(lambda x: torch.sin(x) * 2 + x.cos())\n"
            "x = torch.randn(64)\nstarted = time.perf_counter()\nstep(x)\nprint(f'call {time.perf_counter() - started:.4f}')\n")

MODEL = "import torch\nmodel = torch.nn.Linear(16384, 16384, bias=False)\n"  # 1.07 GB of float32 on each rank
USE = "print('rows', model.weight.shape[0])\n"


def reply(kernel: Kernel, code: str, expect: str = "ok") -> float:
    msg_id, started = kernel.submit(code)
    ran = kernel.collect(msg_id, started, timeout=300)
    if ran.reply["status"] != expect:
        raise RuntimeError(f"expected {expect}: {ran.error_text() or ran.stream()}")
    return ran.reply_at


def wait_shown(kernel: Kernel, msg_id: str, text: str, arrived: Callable[[str, dict], bool] | None = None) -> None:
    """Until ``text`` shows on iopub: in a stream, or where ``arrived(kind, content)`` says (another tool's display)."""
    if arrived is None:
        kernel.wait_for_stream(msg_id, text, timeout=120)
    else:
        kernel.wait_for(msg_id, arrived, text, timeout=120)


def first_line(kernel: Kernel, code: str, arrived: Callable[[str, dict], bool] | None = None) -> float:
    """The request -> ``first-line`` on iopub: in a stream, or where ``arrived(kind, content)`` says (a display)."""
    msg_id, started = kernel.submit(code)
    wait_shown(kernel, msg_id, "first-line", arrived)
    seconds = time.monotonic() - started
    kernel.collect(msg_id, started, timeout=120)
    return seconds


def in_display(text: str) -> Callable[[str, dict], bool]:
    """Whether ``text`` arrived in another tool's rank display (anything on iopub but the code echoed)."""
    return lambda kind, content: kind != "execute_input" and text in json.dumps(content)


def interrupt(kernel: Kernel, code: str, arrived: Callable[[str, dict], bool] | None = None) -> tuple[float, str]:
    """A cell looping in Python, once ``looping`` is shown (in a stream, or where ``arrived`` says): the kernel's
    interrupt -> its reply; and what the cell printed."""
    msg_id, started = kernel.submit(code)
    wait_shown(kernel, msg_id, "looping", arrived)
    asked = time.monotonic()
    kernel.manager.interrupt_kernel()
    ran = kernel.collect(msg_id, started, timeout=120)
    return time.monotonic() - asked, ran.stream()


def kept_interrupt(kernel: Kernel) -> float:
    """taas: the interrupt of a kept cell looping in Python -> its reply, the ranks kept."""
    seconds, printed = interrupt(kernel, KEEP + LOOP)
    if "the ranks are kept" not in printed:
        raise RuntimeError(f"the interrupt did not keep the ranks: {printed}")
    return seconds


def compiled(kernel: Kernel) -> tuple[float, float]:
    kernel.execute("%taas release")
    calls = []
    for _ in range(2):
        ran = kernel.execute(KEEP + COMPILED, timeout=600)
        calls.append(float(ran.stream().split("call ")[1].split()[0]))
    return calls[0], calls[1]


def kept_model(kernel: Kernel, lazy_bytes: int) -> tuple[float, float, float]:
    """With ``lazy_bytes``: the kept cell building :data:`MODEL` to its reply, the kernel's resident growth (GB),
    and a kept cell using it to its reply."""
    reply(kernel, f"%taas release\n%config TaasMagics.lazy_bytes = {lazy_bytes}\nimport torch")
    before = psutil.Process(kernel.pid).memory_info().rss
    built = reply(kernel, KEEP + MODEL)
    grown = (psutil.Process(kernel.pid).memory_info().rss - before) / 1e9
    used = reply(kernel, KEEP + USE)
    reply(kernel, "del model\n%taas release\n%config TaasMagics.lazy_bytes = 64 * 2**20")
    return built, grown, used


@contextlib.contextmanager
def other_kernel(env: dict[str, str], kernel_name: str = "python3") -> Iterator[Kernel]:
    """Another tool's kernel, with this interpreter first on PATH (the tools start "python" from PATH, as in an
    activated venv); ended with its whole process tree, never by the tool's own name-pattern kills."""
    path = os.pathsep.join((os.path.dirname(sys.executable), os.environ.get("PATH", "")))
    kernel = Kernel(kernel_name=kernel_name, load_ext=False, env={**env, "PATH": path})
    try:
        yield kernel
    finally:
        try:
            processes = psutil.Process(kernel.pid).children(recursive=True)  # the kernel of now (it may have restarted)
        except psutil.Error:
            processes = []
        kernel.shutdown()
        for process in processes:
            try:
                process.kill()
            except psutil.Error:
                pass


def two_rows(kernel: Kernel, runs: int, arrived: Callable[[str, dict], bool] | None = None) -> tuple[list[float], list[float]]:
    """On kept processes whose cells already have ``torch`` and ``dist``: the first line ``runs`` times, then the
    all_reduce cell ``runs`` times, each block alone."""
    first, reduce = [], []
    for _ in range(runs):
        time.sleep(0.5)
        first.append(first_line(kernel, FIRST, arrived))
    for _ in range(runs):
        time.sleep(0.5)
        reduce.append(reply(kernel, "dist.all_reduce(torch.ones(1))\n"))
    return first, reduce


def nbdistributed(site: str, runs: int) -> tuple[list[float], list[float]]:
    """nbdistributed's first line and all_reduce cell, ``runs`` times each (see the module docstring)."""
    with other_kernel({"PYTHONPATH": site}) as kernel:
        for setup in ("%load_ext nbdistributed", "%dist_init -n 2"):
            ran = kernel.execute(setup, timeout=300)
            if ran.reply["status"] != "ok":
                raise RuntimeError(f"{setup}: {ran.error_text() or ran.stream()}")
        reply(kernel, "import torch, torch.distributed as dist\n")
        return two_rows(kernel, runs)


def jd_recovery(kernel: Kernel, init: str) -> tuple[float, float, str]:
    """jupyter-distributed after a failed collective: the request -> rank 1's error shown (its live display);
    then, as a person would, the kernel's interrupt, and where the cell still has not replied within
    ``JD_REPLY_SECONDS`` (rank 0 waits in gloo's all_reduce), Jupyter's kernel restart, the group made again
    (``init``), and the next working cell: the error shown -> that cell's reply. And how it got there."""
    msg_id, started = kernel.submit(FAILING_MADE)
    kernel.wait_for(msg_id, in_display("rank 1 gave up"), "rank 1's error", timeout=120)
    shown = time.monotonic()
    kernel.manager.interrupt_kernel()
    how = "interrupt"
    try:
        kernel.collect(msg_id, started, timeout=JD_REPLY_SECONDS)
    except queue.Empty:
        import psutil

        before = psutil.Process(kernel.pid).children(recursive=True)
        kernel.manager.restart_kernel(now=False)  # its proxy ends its rank kernels itself
        kernel.client.wait_for_ready(timeout=300)
        left = [process for process in before if process.is_running() and process.status() != psutil.STATUS_ZOMBIE]
        for process in left:  # what the restarted kernel left running (ended here, and said)
            process.kill()
        how = f"interrupt, no reply in {JD_REPLY_SECONDS:g} s: kernel restart" + (
            f" (it left {len(left)} process(es) running)" if left else "")
        reply(kernel, init)
    reply(kernel, "dist.all_reduce(torch.ones(1))\n")
    return shown - started, time.monotonic() - shown, how


JD_PRINTED = '"first-line\\n"'  # the line as jupyter-distributed's rank display carries it (not the code echoed)


def jd_environment(site: str) -> dict[str, str]:
    """jupyter-distributed's kernel spec (``jdist``, a folder of this run's own) made, and its kernel's environment."""
    specs = tempfile.mkdtemp()
    os.makedirs(os.path.join(specs, "kernels", "jdist"))
    with open(os.path.join(specs, "kernels", "jdist", "kernel.json"), "w") as spec:
        json.dump({"argv": [sys.executable, "-m", "jupyter_distributed.kernel", "-f", "{connection_file}"],
                   "display_name": "jupyter-distributed", "language": "python",
                   "interrupt_mode": "message"}, spec)  # its interrupt_request reaches every rank; a SIGINT does not
    os.environ["JUPYTER_PATH"] = specs  # where this process's kernel manager finds the spec
    return {"PYTHONPATH": site, "JUPYTER_DISTRIBUTED_WORLD_SIZE": "2", "JUPYTER_DISTRIBUTED_BASE_KERNEL": "python3"}


def paired(site: str, runs: int) -> tuple[dict[str, list[float]], dict[str, tuple[list[float], list[float]]]]:
    """taas's kept ranks and jupyter-distributed's kernels alive side by side, both idle between cells: each pair
    is one cell of each, 0.5 s apart, in ABBA order; per pair, taas's time over jupyter-distributed's, for the
    first line and for the all_reduce cell; and each tool's times (taas's, theirs)."""
    init = "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
    ratios: dict[str, list[float]] = {"first": [], "reduce": []}
    seconds: dict[str, tuple[list[float], list[float]]] = {"first": ([], []), "reduce": ([], [])}
    with other_kernel(jd_environment(site), "jdist") as theirs:
        ours = Kernel()
        try:
            reply(theirs, init)
            reply(ours, KEEP + init)
            reduce = "dist.all_reduce(torch.ones(1))\n"  # the same cell in both: their ranks have torch and dist
            cells = {"first": (lambda: first_line(ours, KEEP + FIRST),
                               lambda: first_line(theirs, FIRST, in_display(JD_PRINTED))),
                     "reduce": (lambda: reply(ours, KEEP + reduce), lambda: reply(theirs, reduce))}
            for pair in range(runs):
                for name, (taas_cell, their_cell) in cells.items():
                    order = (taas_cell, their_cell) if pair % 2 == 0 else (their_cell, taas_cell)
                    times = {}
                    for cell in order:
                        time.sleep(0.5)
                        times[cell] = cell()
                    ratios[name].append(times[taas_cell] / times[their_cell])
                    seconds[name][0].append(times[taas_cell])
                    seconds[name][1].append(times[their_cell])
            reply(ours, "%taas release")
        finally:
            ours.shutdown()
    return ratios, seconds


def jupyter_distributed(site: str, runs: int) -> tuple[list[float], list[float]]:
    """jupyter-distributed's first line and all_reduce cell, ``runs`` times each: its proxy kernel (a kernelspec
    of this run's own) over 2 rank kernels, the cells' group made by a first cell (see the module docstring);
    then its recovery and interrupt rows (:data:`JD_MORE`)."""
    init = "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
    with other_kernel(jd_environment(site), "jdist") as kernel:
        reply(kernel, init)
        rows = two_rows(kernel, runs, in_display(JD_PRINTED))
        for _ in range(runs):
            JD_MORE["failed"].append(jd_recovery(kernel, init))
            JD_MORE["interrupt"].append(interrupt(kernel, LOOP, in_display("looping"))[0])
            reply(kernel, "dist.all_reduce(torch.ones(1))\n")  # the group still works after the interrupt
        return rows


JD_REPLY_SECONDS = 10.0  # how long the failed cell is given to reply after jupyter-distributed's interrupt
JD_MORE: dict[str, list] = {"failed": [], "interrupt": []}  # its recovery (3 values a run) and interrupt rows


def row(name: str, values: list[float], beside: list[float] | None, target: str, unit: str = "s") -> str:
    def shown(samples: list[float]) -> str:
        return f"{statistics.median(samples):.3f} {unit} ({min(samples):.3f}-{max(samples):.3f})"

    other = shown(beside) if beside else ""
    return f"| {name} | {shown(values)} | {other} | {target} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--nbdistributed", metavar="SITE", help="a folder holding nbdistributed (see above)")
    parser.add_argument("--jupyter-distributed", metavar="SITE", help="a folder holding jupyter-distributed (see above)")
    parser.add_argument("--paired", action="store_true", help="only the first two rows, taas and jupyter-distributed "
                        "side by side in pairs (needs --jupyter-distributed)")
    arguments = parser.parse_args()
    runs = arguments.runs
    if arguments.paired:
        ratios, seconds = paired(arguments.jupyter_distributed, runs)
        print(f"taas kept / jupyter-distributed, {runs} pairs (ABBA), both kept and idle between cells: median of the "
              "paired ratios (min-max), its 95% interval (bootstrap), and each tool's median (min-max)\n\n| row | taas / "
              "jupyter-distributed | 95% interval | taas kept | jupyter-distributed | target |\n" + "| --- " * 6 + "|")
        for name, title in (("first", "first line"), ("reduce", "a cell with an all_reduce, to its reply")):
            ours, theirs = (row("", times, None, "").split(" | ")[1] for times in seconds[name])
            interval = "-".join(f"{bound:.3f}" for bound in median_interval(ratios[name]))
            shown = f" | {interval} x | {ours} | {theirs} | <="
            print(row(title, ratios[name], None, "<= 1.00x", "x").replace(" |  | <=", shown))
        return
    kernel = Kernel()
    try:
        rows: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in ("first", "reduce", "failed", "shown", "next")}
        interrupts: list[float] = []
        reply(kernel, KEEP + "pass\n")
        reply(kernel, FRESH + "pass\n")
        for _ in range(runs):  # each block alone: a fresh cell's spares warming must not slow a kept one
            time.sleep(0.5)
            rows["first"][0].append(first_line(kernel, KEEP + FIRST))
        for _ in range(runs):
            time.sleep(0.5)
            rows["reduce"][0].append(reply(kernel, KEEP + ALL_REDUCE))
        for _ in range(runs):
            time.sleep(2)  # the spares ready
            rows["first"][1].append(first_line(kernel, FRESH + FIRST))
            time.sleep(2)
            rows["reduce"][1].append(reply(kernel, FRESH + ALL_REDUCE))
        for _ in range(runs):
            reply(kernel, KEEP + MAKE_GROUP)  # as jupyter-distributed's is: made before the failing cell
            msg_id, started = kernel.submit(KEEP + FAILING)
            kernel.wait_for_stream(msg_id, "rank 1 gave up", timeout=120)  # the cell's line, before its error
            shown = time.monotonic() - started
            rows["shown"][0].append(shown)
            failed = kernel.collect(msg_id, started, timeout=120)
            assert failed.reply["status"] == "error", failed.stream()
            rows["failed"][0].append(failed.reply_at)
            # the error shown -> the next working cell's reply, sent the moment the failed cell ended
            rows["next"][0].append(failed.reply_at - shown + reply(kernel, KEEP + "pass\n"))
            interrupts.append(kept_interrupt(kernel))
        first_call, second_call = compiled(kernel)
        models = {lazy: [kept_model(kernel, lazy) for _ in range(min(runs, 3))] for lazy in (64 * 2**20, 0)}
        kernel.execute("%taas release")
    finally:
        kernel.shutdown()
    others = {name: measure(site, runs) for name, measure, site in (
        ("nbdistributed", nbdistributed, arguments.nbdistributed),
        ("jupyter-distributed", jupyter_distributed, arguments.jupyter_distributed)) if site}
    print(f"kept ranks beside fresh warm ranks, 2 CPU ranks (gloo), {runs} runs each: median (min-max)\n")
    print("| row | kept | fresh (warm spares) | target |\n| --- | --- | --- | --- |")
    print(row("first line", *rows["first"], "kept <= 0.020 s"))
    print(row("a cell with an all_reduce, to its reply", *rows["reduce"], ""))
    print(row("failed collective: request to rank 1's error shown", rows["shown"][0], None, ""))
    print(row("failed collective: request to the error (the cell's end)", rows["failed"][0], None, ""))
    print(row("failed collective: the error shown to the next working cell", rows["next"][0], None, "<= 5 s"))
    print(row("interrupt: the interrupt to the reply, ranks kept", interrupts, None, "<= 3 s"))
    print(f"| compiled: first call (compiling) / next call in kept ranks | {first_call:.3f} s / {second_call:.4f} s "
          f"= {second_call / first_call:.1%} | | <= 5% |")
    print(f"\na 1 GB model kept (nn.Linear(16384, 16384) on each rank), {min(runs, 3)} runs each\n")
    print("| row | left on rank 0 until touched (default) | lazy_bytes = 0: copied into the notebook | target |\n"
          "| --- | --- | --- | --- |")
    for k, (title, unit) in enumerate((("the cell that builds it, to its reply", "s"),
                                       ("the kernel's resident memory after it", "GB"),
                                       ("a kept cell that uses it, to its reply", "s"))):
        print(row(title, [m[k] for m in models[64 * 2**20]], [m[k] for m in models[0]], "", unit))
    for name, (first, reduce) in others.items():
        print(f"\n{name}'s kept processes (2 ranks, gloo), the same cells\n")
        print(f"| row | {name} | taas kept (above) |\n| --- | --- | --- |")
        more = JD_MORE if name == "jupyter-distributed" else {"failed": [], "interrupt": []}
        failed = more["failed"]
        for title, theirs, ours in (("first line", first, rows["first"][0]),
                                    ("a cell with an all_reduce, to its reply", reduce, rows["reduce"][0]),
                                    ("failed collective: request to rank 1's error shown", [f[0] for f in failed],
                                     rows["shown"][0]),
                                    ("failed collective: the error shown to the next working cell", [f[1] for f in failed],
                                     rows["next"][0]),
                                    ("interrupt: the interrupt to the reply", more["interrupt"], interrupts)):
            if theirs:
                print(row(title, theirs, ours, "").rsplit(" |  |", 1)[0] + " |")
        if failed:
            print(f"\n{name} after the failed collective: " + "; ".join(sorted({f[2] for f in failed})))


if __name__ == "__main__":
    main()
