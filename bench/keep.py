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

``--failures`` (with ``--jupyter-distributed``): what a failure costs, taas's kept ranks and jupyter-distributed's
kernels side by side, one of each per pair (alternating which goes first), the group made and a global bound by a
cell before: a failed collective (rank 1 raises while rank 0 waits in ``all_reduce``), its request -> the reply of
the next working cell (an ``all_reduce`` that prints the global: taas's ranks keep it; jupyter-distributed's interrupt
cannot end its cell, so the person restarts the kernel and makes the group again, and the global is gone), target
at most 3 s; and the interrupt of a cell stuck in a collective (rank 1 loops in Python, rank 0 waits in
``all_reduce``), the interrupt -> the reply (taas: the autopsy, then the ranks kept; jupyter-distributed: no reply
within 10 s, so the restart, to the next working cell); and a rank killed (rank 1 SIGKILLs itself while rank 0 waits
in ``all_reduce``), its request -> the next kept cell's first line, an ``all_reduce`` done with the new rank 1 (taas:
rank 0 keeps the global; jupyter-distributed: the interrupt, then the restart, to the next working cell's reply).
Each with the median of the paired ratios.

``--paired`` (with ``--jupyter-distributed``): only the first two rows, taas's kept ranks and jupyter-distributed's
side by side in ABBA pairs; the median of the paired ratios and its 95% interval (bench/intervals.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cells import ALL_REDUCE, FAILING, FIRST, FRESH, KEEP, LOOP, MAKE_GROUP, first_line, interrupt, reply, row  # noqa: E402
from bench.intervals import median_interval  # noqa: E402
from bench.othertools import JD_MORE, jd_environment, jd_recovery, jupyter_distributed, nbdistributed, other_kernel, paired  # noqa: E402
from tests.kernel_client import Kernel  # noqa: E402

COMPILED = ("import time, torch\nif 'step' not in globals():\n"
            "    step = torch.compile(lambda x: torch.sin(x) * 2 + x.cos())\n"
            "x = torch.randn(64)\nstarted = time.perf_counter()\nstep(x)\nprint(f'call {time.perf_counter() - started:.4f}')\n")

MODEL = "import torch\nmodel = torch.nn.Linear(16384, 16384, bias=False)\n"  # 1.07 GB of float32 on each rank
USE = "print('rows', model.weight.shape[0])\n"












STATE = "state = 'kept'\n"
NEXT = "dist.all_reduce(torch.ones(1))\nprint('state', globals().get('state', 'lost'))\n"
STUCK = ("import time\nprint('looping', flush=True)\nif dist.get_rank() == 1:\n    while True:\n        time.sleep(0.01)\n"
         "dist.all_reduce(torch.ones(1))\n")
KILLED = ("import os, signal, time\nprint('killing', flush=True)\ntime.sleep(0.2)\nif dist.get_rank() == 1:\n"
          "    os.kill(os.getpid(), signal.SIGKILL)\ndist.all_reduce(torch.ones(1))\n")
FIRST_AFTER = ("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
               "print('first', t.item(), 'state', globals().get('state', 'lost'))\n")


def taas_failed_to_next(kernel: Kernel) -> tuple[float, str]:
    """taas: a failed collective's request -> the next working kept cell's reply; what that cell printed."""
    msg_id, started = kernel.submit(KEEP + FAILING.replace("dist.init_process_group('gloo')\n", ""))
    failed = kernel.collect(msg_id, started, timeout=120)
    if failed.reply["status"] != "error" or "the ranks are kept" not in failed.error_text() + failed.stream():
        raise RuntimeError(f"the failed collective did not keep the ranks: {failed.error_text()}")
    ran = kernel.execute(KEEP + NEXT)
    return time.monotonic() - started, ran.stream()


def taas_stuck_interrupt(kernel: Kernel) -> float:
    """taas: the interrupt of a kept cell stuck in a collective -> its reply, the ranks kept."""
    msg_id, started = kernel.submit(KEEP + STUCK)
    kernel.wait_for_stream(msg_id, "looping", timeout=120)
    time.sleep(0.5)  # rank 0 is in its all_reduce
    asked = time.monotonic()
    kernel.manager.interrupt_kernel()
    ran = kernel.collect(msg_id, started, timeout=120)
    seconds = time.monotonic() - asked
    if "the ranks are kept" not in ran.stream():
        raise RuntimeError(f"the interrupt did not keep the ranks: {ran.stream()}")
    return seconds


def taas_killed_to_first_line(kernel: Kernel) -> tuple[float, str]:
    """taas: a kept cell where rank 1 is killed (SIGKILL) while rank 0 waits in all_reduce, its request -> the next
    kept cell's first line (an all_reduce with the new rank 1 done); what that cell printed."""
    msg_id, started = kernel.submit(KEEP + KILLED)
    failed = kernel.collect(msg_id, started, timeout=120)
    if "the other ranks are kept" not in failed.error_text() + failed.stream():
        raise RuntimeError(f"the killed rank's cell did not keep the others: {failed.error_text()}")
    msg_id, next_started = kernel.submit(KEEP + FIRST_AFTER)
    kernel.wait_for_stream(msg_id, "first", timeout=120)
    seconds = time.monotonic() - started
    return seconds, kernel.collect(msg_id, next_started, timeout=120).stream()


def failures(site: str, runs: int) -> dict[str, tuple[list[float], list[float], set[str]]]:
    """``--failures`` (see the module docstring): per row, taas's seconds, jupyter-distributed's, and what each
    printed of the global (or how jupyter-distributed got back)."""
    init = "import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
    rows: dict[str, tuple[list[float], list[float], set[str]]] = {
        "failed": ([], [], set()), "stuck": ([], [], set()), "killed": ([], [], set())}
    with other_kernel(jd_environment(site), "jdist") as theirs:
        ours = Kernel()
        try:
            reply(ours, KEEP + init + STATE)
            reply(theirs, init + STATE)
            for pair in range(runs):
                def taas_failed() -> None:
                    seconds, printed = taas_failed_to_next(ours)
                    rows["failed"][0].append(seconds)
                    rows["failed"][2].add("taas: " + " ".join(sorted(set(re.findall(r"state \w+", printed)))))

                def their_failed() -> None:
                    shown, recovered, how = jd_recovery(theirs, init)
                    rows["failed"][1].append(shown + recovered)
                    rows["failed"][2].add(f"jupyter-distributed: {how}; "
                                          + said_state(theirs, "print('state', globals().get('state', 'lost'))\n"))
                    reply(theirs, STATE)  # bound again for the next pair

                def taas_stuck() -> None:
                    rows["stuck"][0].append(taas_stuck_interrupt(ours))

                def their_stuck() -> None:
                    _, recovered, how = jd_recovery(theirs, init, STUCK, "looping", interrupt_at_once=False)
                    rows["stuck"][1].append(recovered)
                    rows["stuck"][2].add(f"jupyter-distributed: {how}")
                    reply(theirs, STATE)

                def taas_killed() -> None:
                    seconds, _ = taas_killed_to_first_line(ours)
                    rows["killed"][0].append(seconds)
                    rows["killed"][2].add("taas: rank 0's " + said_state(
                        ours, KEEP + "print('state', globals().get('state', 'lost'))\n"))

                def their_killed() -> None:
                    shown, recovered, how = jd_recovery(theirs, init, KILLED, "killing", interrupt_at_once=False)
                    rows["killed"][1].append(shown + recovered)
                    rows["killed"][2].add(f"jupyter-distributed: {how}; "
                                          + said_state(theirs, "print('state', globals().get('state', 'lost'))\n"))
                    reply(theirs, STATE)

                for first, second in ((taas_failed, their_failed), (taas_stuck, their_stuck),
                                      (taas_killed, their_killed)):
                    for cell in (first, second) if pair % 2 == 0 else (second, first):
                        time.sleep(0.5)
                        cell()
            reply(ours, "%taas release")
        finally:
            ours.shutdown()
    return rows


def said_state(kernel: Kernel, code: str) -> str:
    """``state kept`` or ``state lost``, as a cell printed it (in a stream, or another tool's rank display)."""
    ran = kernel.execute(code)
    found = re.findall(r"state (kept|lost)", json.dumps([message.content for message in ran.messages
                                                         if message.type != "execute_input"]))
    return f"state {found[0]}" if found else "state not shown"


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






















def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--nbdistributed", metavar="SITE", help="a folder holding nbdistributed (see above)")
    parser.add_argument("--jupyter-distributed", metavar="SITE", help="a folder holding jupyter-distributed (see above)")
    parser.add_argument("--failures", action="store_true", help="what a failure costs, taas and jupyter-distributed "
                        "side by side in pairs (needs --jupyter-distributed)")
    parser.add_argument("--paired", action="store_true", help="only the first two rows, taas and jupyter-distributed "
                        "side by side in pairs (needs --jupyter-distributed)")
    arguments = parser.parse_args()
    runs = arguments.runs
    if arguments.failures:
        failed = failures(arguments.jupyter_distributed, runs)
        print(f"what a failure costs: taas kept / jupyter-distributed, {runs} pairs (alternating), 2 CPU ranks (gloo): "
              "median (min-max)\n\n| row | taas kept | jupyter-distributed | taas / jupyter-distributed | target |\n"
              + "| --- " * 5 + "|")
        for name, title, target in (("failed", "failed collective: request to the next working cell's reply", "<= 3 s"),
                                    ("stuck", "interrupt of a cell stuck in a collective: to its reply (jupyter-"
                                     "distributed: to the next working cell)", "<= 3 s"),
                                    ("killed", "rank 1 killed in a collective: request to the next kept cell's first "
                                     "line (jupyter-distributed: to the next working cell's reply)", "")):
            ours, theirs, said = failed[name]
            ratios = [a / b for a, b in zip(ours, theirs)]
            print(f"| {title} | " + " | ".join(row("", values, None, "", unit).split(" | ")[1] for values, unit in (
                (ours, "s"), (theirs, "s"), (ratios, "x"))) + f" | {target} |")
        for name in failed:
            print(f"\n{name}: " + "; ".join(sorted(failed[name][2])))
        return
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
