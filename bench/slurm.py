"""The Slurm engine's cost on a real multi-node Slurm on this machine, beside srun's floor and submitit.

    python bench/slurm.py [--repeats 5]

Needs root and Debian's slurm-wlm and munge (tests/slurm/minislurm.py starts 3 nodes of 2 fake
GPUs each); submitit (``pip install submitit``) for its column. In one run, alternating:

- cell: a kernel holding a 2-node allocation (``%taas cluster slurm --nodes 2 --gpus-per-node 2``)
  runs ``#pragma taas --gpus 2`` whose rank 0 prints its first line; timed from execute_request to
  that line on iopub. Floor: an ``srun`` step of ``true`` in the same allocation (what a new step
  costs), and, beside it, a 2-task step of the kernel's Python printing a line (``srun -n2
  --gpus-per-task=1 python -c print``: what any step that runs Python costs). Target: at most 0.5 s
  above the ``true`` floor.
- submitit: ``AutoExecutor(...).submit(f)`` of a function printing the same line and returning,
  one sbatch job of 2 tasks with a GPU each, timed from submit to ``job.result()``: what a person
  uses today (a job per call, then its polling).
- interrupt: a 4-rank cell over both nodes sleeping; from the kernel's interrupt to no rank or
  task process left on any node and no step of the cell in ``squeue``. Target: 3 s. Beside it,
  once (it is slow): submitit's ``job.cancel()`` of a running job, to the job gone from ``squeue``
  (the test Slurm's ``KillWait`` is 30 s, Slurm's default).
- restart: a 2-rank cell with ``--restarts 1`` whose rank 1 notes the time and SIGKILLs itself;
  from that death to the next attempt's first rank-0 line on iopub (a new step). Target: 2 s.

Medians of --repeats, with (min, max); ratios are of medians measured in this run.
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

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.kernel_client import Kernel, started_here, wait_until_gone  # noqa: E402
from tests.slurm.minislurm import MiniSlurm, missing  # noqa: E402

FIRST_CELL = "#pragma taas --gpus 2\nimport os\nif os.environ['RANK'] == '0':\n    print('first-line', flush=True)\n"
SLEEPING = "#pragma taas --gpus 4\nimport time\nprint('sleeping', flush=True)\ntime.sleep(120)\n"
DYING = """\
#pragma taas --gpus 2 --restarts 1
import os, signal, time, torch.distributed as dist
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if os.environ["RANK"] == "0":
    print(f"first-line {{attempt}}", flush=True)
dist.init_process_group("gloo", init_method="env://")
if attempt == 0:
    time.sleep(1.0)
    if dist.get_rank() == 1:
        open({death!r}, "w").write(f"{{time.time():.6f}}")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
dist.destroy_process_group()
"""


def first_line(content: dict) -> bool:
    return "first-line" in content.get("text", "")


def time_cell(kernel: Kernel) -> float:
    msg_id, started = kernel.submit(FIRST_CELL)
    kernel.wait_for(msg_id, lambda kind, content: kind == "stream" and first_line(content), "first line", timeout=120)
    seconds = time.monotonic() - started
    ran = kernel.collect(msg_id, started)
    assert ran.reply["status"] == "ok", ran.error_text()
    return seconds


def time_srun(slurm: MiniSlurm, job: str, *command: str) -> float:
    started = time.monotonic()
    done = subprocess.run(["srun", f"--jobid={job}", "--quiet", *command], env=slurm.env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return time.monotonic() - started


def say_first_line() -> int:
    print("first-line", flush=True)
    return 1


def time_submitit(slurm: MiniSlurm, folder: Path) -> float | None:
    try:
        import submitit
    except ImportError:
        return None
    os.environ["SLURM_CONF"] = str(slurm.conf)
    executor = submitit.AutoExecutor(folder=str(folder / "submitit"), cluster="slurm")
    executor.update_parameters(slurm_partition="gpu", nodes=1, tasks_per_node=2, gpus_per_node=2, timeout_min=5)
    started = time.monotonic()
    job = executor.submit(say_first_line)
    job.results()
    return time.monotonic() - started


def sleep_long() -> None:
    time.sleep(300)


def time_submitit_cancel(slurm: MiniSlurm, folder: Path) -> float | None:
    """submitit's cancel of a running 2-task job: from ``job.cancel()`` to the job gone from ``squeue``."""
    try:
        import submitit
    except ImportError:
        return None
    executor = submitit.AutoExecutor(folder=str(folder / "submitit"), cluster="slurm")
    executor.update_parameters(slurm_partition="gpu", nodes=1, tasks_per_node=2, gpus_per_node=2, timeout_min=5)
    job = executor.submit(sleep_long)
    while "RUNNING" not in slurm.run("squeue", "-h", "-j", str(job.job_id), "-o", "%T", check=False):
        time.sleep(0.05)
    time.sleep(2.0)  # its tasks are running the function
    started = time.monotonic()
    job.cancel(check=False)
    while slurm.run("squeue", "-h", "-j", str(job.job_id), "-o", "%T", check=False).strip():
        time.sleep(0.05)
    return time.monotonic() - started


def cell_processes() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if started_here(proc) and ("-m taas_magic.rank" in line or "taas_magic.launch.slurm.task" in line):
            found.append(proc)
    return found


def time_interrupt(kernel: Kernel, slurm: MiniSlurm, job: str) -> float:
    msg_id, started = kernel.submit(SLEEPING)
    kernel.wait_for_stream(msg_id, "sleeping", timeout=120)
    running = cell_processes()
    interrupted = time.monotonic()
    kernel.manager.interrupt_kernel()
    alive = wait_until_gone(running, timeout=30)
    while any(not line.split()[0].endswith((".extern", ".interactive"))
              for line in slurm.run("squeue", "-h", "-s", "-j", job, "-o", "%i", check=False).split()):
        time.sleep(0.02)
    seconds = time.monotonic() - interrupted
    kernel.collect(msg_id, started)
    assert not alive, alive
    return seconds


def time_restart(kernel: Kernel, death: Path) -> float:
    death.unlink(missing_ok=True)
    msg_id, _ = kernel.submit(DYING.format(death=str(death)))
    kernel.wait_for_stream(msg_id, "first-line 1", timeout=120)
    arrived = time.time()
    ran = kernel.collect(msg_id, time.monotonic())
    assert ran.reply["status"] == "ok", ran.error_text()
    return arrived - float(death.read_text())


def row(name: str, values: list[float], floor: str, beside: str) -> str:
    if not values:
        return f"{name:<44} {'-':>8}   {'':>17}  {floor:<34} {beside}"
    return (f"{name:<44} {statistics.median(values):8.3f} s ({min(values):.3f}, {max(values):.3f})  "
            f"{floor:<34} {beside}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    why = missing()
    if why is not None:
        sys.exit(f"bench/slurm.py: {why}")
    folder = Path(tempfile.mkdtemp(prefix="taas-bench-slurm-"))
    figures: dict[str, list[float]] = {name: [] for name in ("cell", "true", "python", "submitit", "interrupt", "restart")}
    with MiniSlurm(nodes=3) as slurm:
        work = folder / "work"  # the kernel's folder: rank 1's death note goes outside it (the write rule diverts it there)
        work.mkdir()
        kernel = Kernel(cwd=str(work), env={"SLURM_CONF": str(slurm.conf)})
        try:
            ran = kernel.execute("%taas cluster slurm --nodes 2 --gpus-per-node 2", timeout=120)
            assert ran.reply["status"] == "ok", ran.error_text()
            job = ran.stream().split("Slurm job ")[1].split()[0]
            time_cell(kernel)  # the first cell pays the nodes' page cache
            for _ in range(args.repeats):
                figures["cell"].append(time_cell(kernel))
                figures["true"].append(time_srun(slurm, job, "-n1", "true"))
                figures["python"].append(time_srun(slurm, job, "-n2", "--gpus-per-task=1", sys.executable, "-c",
                                                   "print('first-line')"))
                submitted = time_submitit(slurm, folder)
                if submitted is not None:
                    figures["submitit"].append(submitted)
                figures["interrupt"].append(time_interrupt(kernel, slurm, job))
                figures["restart"].append(time_restart(kernel, folder / "death"))
        finally:
            kernel.shutdown()
        cancelled = time_submitit_cancel(slurm, folder)
    median = {name: statistics.median(values) for name, values in figures.items() if values}
    print(f"\nSlurm 22.05 on this machine, 3 nodes of 2 GPUs (fake), {args.repeats} runs each, medians (min, max)\n")
    print(f"{'':<44} {'median':>10} {'(min, max)':>17}  {'floor / target':<34} beside")
    print(row("taas cell -> rank 0's first line", figures["cell"],
              f"srun true {median['true']:.3f} s: +{median['cell'] - median['true']:.3f} s (target +0.5 s)",
              f"submitit {median['submitit']:.3f} s ({median['submitit'] / median['cell']:.1f}x)" if "submitit" in median
              else "submitit: not installed"))
    print(row("srun step of true (the floor)", figures["true"], "", ""))
    print(row("srun -n2 --gpus-per-task=1 python -c print", figures["python"], "any Python step", ""))
    print(row("submitit submit -> result (2 tasks)", figures["submitit"], "", "one sbatch job per call"))
    print(row("interrupt -> nothing left, step gone", figures["interrupt"], "target 3 s",
              f"submitit's cancel -> job gone: {cancelled:.1f} s (1 run; KillWait=30)" if cancelled is not None else ""))
    print(row("restart: death -> next first line", figures["restart"], "target 2 s", ""))


if __name__ == "__main__":
    main()
