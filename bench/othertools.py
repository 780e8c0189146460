"""The other tools' kept processes, run as a person would: nbdistributed and jupyter-distributed, each in a kernel
of its own, on the cells bench/keep.py runs on taas (see its docstring for what each row measures and why).

Runs in bench/keep.py's process.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import tempfile
import time
from typing import Callable, Iterator

import psutil

from bench.cells import FAILING_MADE, FIRST, KEEP, LOOP, first_line, in_display, interrupt, reply
from tests.kernel_client import Kernel


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



def jd_recovery(kernel: Kernel, init: str, cell: str = FAILING_MADE, shown_text: str = "rank 1 gave up",
                interrupt_at_once: bool = True) -> tuple[float, float, str]:
    """jupyter-distributed after a failed (or stuck) collective: the request of ``cell`` -> ``shown_text`` shown
    (its live display: rank 1's error, or that it loops); then, as a person would, the kernel's interrupt, and where
    the cell still has not replied within ``JD_REPLY_SECONDS`` (rank 0 waits in gloo's all_reduce), Jupyter's
    kernel restart, the group made again (``init``), and the next working cell: shown (or, with
    ``interrupt_at_once`` False, the interrupt 0.5 s later) -> that cell's reply. And how it got there."""
    msg_id, started = kernel.submit(cell)
    kernel.wait_for(msg_id, in_display(shown_text), shown_text, timeout=120)
    shown = time.monotonic()
    if not interrupt_at_once:
        time.sleep(0.5)  # rank 0 is in its all_reduce
        shown = time.monotonic()
    kernel.manager.interrupt_kernel()
    how = "interrupt"
    try:
        kernel.collect(msg_id, started, timeout=JD_REPLY_SECONDS)
    except queue.Empty:
        how = _jd_restart(kernel, init, f"interrupt, no reply in {JD_REPLY_SECONDS:g} s: kernel restart")
    if kernel.execute("dist.all_reduce(torch.ones(1))\n", timeout=120).reply["status"] != "ok":
        how = _jd_restart(kernel, init, "interrupt, then the next cell failed (a rank kernel is gone): kernel restart")
        reply(kernel, "dist.all_reduce(torch.ones(1))\n")
    return shown - started, time.monotonic() - shown, how


def _jd_restart(kernel: Kernel, init: str, how: str) -> str:
    """jupyter-distributed's way back: Jupyter's kernel restart, what it left running ended, the group made again."""
    before = psutil.Process(kernel.pid).children(recursive=True)
    kernel.manager.restart_kernel(now=False)  # its proxy ends its rank kernels itself
    kernel.client.wait_for_ready(timeout=300)
    left = [process for process in before if process.is_running() and process.status() != psutil.STATUS_ZOMBIE]
    for process in left:  # what the restarted kernel left running (ended here, and said)
        process.kill()
    reply(kernel, init)
    return how + (f" (it left {len(left)} process(es) running)" if left else "")


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

