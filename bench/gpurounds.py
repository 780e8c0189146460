"""bench/gpu.py's rounds: launch, transfer, throughput, reports and restart, each adding to the Figures.

Read bench/gpu.py's docstring for what each round measures and against what.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench.gpucells import (
    CLOSURE_CELL,
    DEADLINE_SECONDS,
    DYING,
    EMPTY_CELL,
    FLOORS,
    GIB,
    LAUNCH,
    REPORTS,
    RESULT_CELL,
    THROUGHPUT,
    Figures,
    _plain,
    arrival,
    floor_launch,
    run_cell,
    taas_launch,
    torchrun,
    with_deadline,
)


def launch_round(folder: Path, notes: Path, gpus: int, settle: float, figures: Figures) -> str:
    """A fresh kernel: cold, 1 s later, 30 s later. In the 30 s, once the spares are warm and the
    kernel idle, the plain processes run: the floor, torchrun's launch and torchrun's restart."""
    from bench.launch import wait_for_spares
    from tests.kernel_client import Kernel

    script = folder / "launch.py"
    script.write_text(LAUNCH)
    kernel = Kernel(cwd=str(folder))
    try:
        header = taas_launch(kernel, figures, "cold")
        time.sleep(1.0)
        taas_launch(kernel, figures, "warm, 1 s after")
        ended = time.monotonic()
        wait_for_spares(kernel, gpus)  # floor and torchrun do not compete with the spares' warm-up
        for name, run in (("floor", lambda: floor_launch(script, gpus)), ("torchrun", lambda: torchrun(script, gpus))):
            outcome = with_deadline(run, spare=kernel)
            if isinstance(outcome, str):
                figures.note(name, outcome)
            else:
                figures.add(f"{name}: first line", outcome["first-line"][0])
                figures.add(f"{name}: all_reduce done", outcome["reduced"][0])
        add_torchrun_restart(notes, gpus, settle, figures, kernel)
        gap = time.monotonic() - ended
        if gap > 30:
            figures.note("warm, 30 s after", f"a gap of {gap:.0f} s (floor and torchrun took longer)")
        time.sleep(max(0.0, 30 - gap))
        taas_launch(kernel, figures, "warm, 30 s after")
        return header
    finally:
        kernel.shutdown()


# -- transfer -------------------------------------------------------------------------------

def _status(pid: int) -> int:
    """A process's anonymous resident bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _shm_used() -> int:
    stat = os.statvfs("/dev/shm")
    return (stat.f_blocks - stat.f_bfree) * stat.f_frsize


class HostPeak:
    """Peak growth of host memory while the block runs, sampled every 5 ms: the anonymous
    resident pages of each watched process (from when it was added) plus /dev/shm's use
    (the memory files, counted once however many processes map them)."""

    def __init__(self, *pids: int):
        self.start: dict[int, int] = {}
        self.peak = 0
        self._stop = threading.Event()
        self._shm = _shm_used()
        for pid in pids:
            self.add(pid)

    def add(self, pid: int, base: int | None = None) -> None:
        """Watch ``pid`` from ``base`` bytes (what it reported itself, before it grew), or from now."""
        self.start[pid] = _status(pid) if base is None else base

    def _sample(self) -> None:
        while not self._stop.is_set():
            anon = sum(max(0, _status(pid) - base) for pid, base in list(self.start.items()))
            self.peak = max(self.peak, anon + max(0, _shm_used() - self._shm))
            time.sleep(0.005)

    def __enter__(self) -> "HostPeak":
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _probe(text: str, word: str) -> tuple[int, int, int, int]:
    """(pid, anonymous resident bytes, CUDA bytes allocated, CUDA peak) from a PROBE line."""
    fields = text.split(word + " ", 1)[1].split()
    pid, anon, allocated, peak = (int(value) for value in fields[:4])
    return pid, anon, allocated, peak


def _kernel_gpu_growth(kernel: Any) -> int:
    ran = run_cell(kernel, "print('peak', torch.cuda.max_memory_allocated() - _base)")
    return int(ran.stream("stdout").split()[1])


def _way(text: str) -> str:
    if "CUDA IPC" in text:
        return "CUDA IPC"
    if "host memory" in text:
        return "host memory"
    return "?"


RESET = ("import torch\n{setup}\ntorch.cuda.synchronize()\ntorch.cuda.empty_cache()\n"
         "torch.cuda.reset_peak_memory_stats()\n_base = torch.cuda.memory_allocated()")


def result_round(kernel: Any, gpus: int, figures: Figures) -> None:
    """A 1 GiB CUDA tensor made by rank 0: its last line -> the names bound; copies at the peak."""
    from bench.launch import wait_for_spares

    run_cell(kernel, RESET.format(setup="result = None"))
    wait_for_spares(kernel, gpus)
    with HostPeak(kernel.pid) as host:
        msg_id, started = kernel.submit(RESULT_CELL)
        seen = kernel.wait_for_stream(msg_id, "last ", timeout=300)
        last = time.monotonic() - started
        text = "".join(m.content["text"] for m in seen if m.type == "stream")
        pid, anon, _, rank_peak = _probe(text, "last")
        host.add(pid, anon)  # from before it packed its results (it may have begun by now)
        ran = kernel.collect(msg_id, started, timeout=600)
    if ran.reply["status"] != "ok":
        raise RuntimeError(_plain(ran.error_text()))
    figures.add("result: last line -> bound", ran.reply_at - last)
    figures.note("result way", _way(text + ran.stream()))
    figures.add("result: GPU copies", (rank_peak + _kernel_gpu_growth(kernel)) / GIB)
    figures.add("result: host copies", host.peak / GIB)
    run_cell(kernel, "assert result.is_cuda and result.numel() * 4 == 2**30\nresult = None")


def closure_round(kernel: Any, gpus: int, figures: Figures, empty: dict) -> None:
    """The notebook holds 1 GiB on its GPU; a cell reads it: rank 0's first line; copies at the peak.
    The same cell capturing nothing runs once (``empty`` keeps its first line and the rank's memory)."""
    from bench.launch import wait_for_spares

    run_cell(kernel, RESET.format(setup=f"captured = None\ncaptured = torch.ones({GIB // 4}, device='cuda')"))
    wait_for_spares(kernel, gpus)
    with HostPeak(kernel.pid) as host:
        ran = run_cell(kernel, CLOSURE_CELL)
    _, anon, _, rank_peak = _probe(ran.stream("stdout"), "first")
    kernel_growth = _kernel_gpu_growth(kernel)
    run_cell(kernel, "captured = None\ntorch.cuda.empty_cache()")
    if not empty:
        wait_for_spares(kernel, gpus)
        nothing = run_cell(kernel, EMPTY_CELL)  # the same rank, capturing nothing
        empty.update(first=arrival(nothing, "first "), anon=_probe(nothing.stream("stdout"), "first")[1])
    figures.add("closure: first line", arrival(ran, "first "))
    figures.add("closure: added", arrival(ran, "first ") - empty["first"])
    text = ran.stream()
    figures.note("closure way", _way(text) if _way(text) != "?" else
                 ("mapped (nothing allocated in the rank)" if rank_peak < GIB // 2 else "copied into the rank"))
    figures.add("closure: GPU copies", (GIB + kernel_growth + rank_peak) / GIB)
    figures.add("closure: host copies", (host.peak + max(0, anon - empty["anon"])) / GIB)
    figures.values["closure: capturing nothing"] = [empty["first"]]


def transfer_floors(repeats: int) -> dict:
    """D2H + H2D and D2D of 1 GiB in a plain process (medians), and what the GPU is."""
    run = subprocess.run([sys.executable, "-c", FLOORS, str(GIB), str(repeats)], capture_output=True, text=True,
                         timeout=DEADLINE_SECONDS)
    if run.returncode != 0:
        raise RuntimeError(run.stderr.strip().splitlines()[-1] if run.stderr.strip() else "the floors failed")
    found = json.loads(run.stdout.strip().splitlines()[-1])
    found["medians"] = {name: statistics.median(times) for name, times in found["times"].items()}
    return found


# -- throughput, reports, restart -------------------------------------------------------------

def throughput_pairs(kernel: Any, folder: Path, gpus: int, steps: int, repeats: int, figures: Figures) -> None:
    """--repeats pairs of a taas cell and torchrun on the same script, ABBA; the paired ratios."""
    from bench.launch import wait_for_spares

    script = folder / "throughput.py"
    script.write_text(THROUGHPUT.format(steps=steps))

    def ours() -> float:
        wait_for_spares(kernel, gpus)  # what a person's next cell finds, seconds later
        ran = run_cell(kernel, "#pragma taas --gpus auto\n" + THROUGHPUT.format(steps=steps))
        # the spares it refills warm up while torchrun starts, long before its timed steps
        return float(ran.stream("stdout").split("steps_per_sec ")[1].split()[0])

    def theirs() -> float | str:
        outcome = with_deadline(lambda: torchrun(script, gpus)["steps_per_sec"][1], spare=kernel)
        return outcome if outcome.startswith(("hung", "failed")) else float(outcome.split()[1])

    for pair in range(repeats):
        if pair % 2 == 0:
            taas_rate, other = ours(), theirs()
        else:
            other, taas_rate = theirs(), ours()
        figures.add("taas steps/s", taas_rate)
        if isinstance(other, str):
            figures.note("torchrun steps/s", other)
            continue
        figures.add("torchrun steps/s", other)
        figures.add("paired ratio", taas_rate / other)


def report_costs(kernel: Any, gpus: int, steps: int, repeats: int, figures: Figures) -> None:
    """Inside the ranks: the step bare, with taas.report(loss=<CUDA tensor>), with loss.item(); ABBA pairs."""
    import ast

    from bench.launch import wait_for_spares

    wait_for_spares(kernel, gpus)
    run_cell(kernel, "#pragma taas --gpus auto\n" + REPORTS.format(steps=steps, repeats=repeats), timeout=1800)
    ratios, bare_times = ast.literal_eval(run_cell(kernel, "figures").result["text/plain"])
    for way, values in ratios.items():
        for value in values:
            figures.add(f"{way} every step", value)
    for value in bare_times:
        figures.add("bare step", value)
    arrived = run_cell(kernel, "import taas\nprint('metrics', len(taas.metrics()))").stream("stdout").split()[1]
    figures.note("reports arrived", f"{arrived} of {steps * repeats} in taas.metrics()")


def restart_round(kernel: Any, notes: Path, gpus: int, settle: float, figures: Figures, with_torchrun: bool) -> None:
    """The last rank SIGKILLs itself; its death -> the next attempt's first rank-0 line on iopub."""
    from bench.launch import wait_for_spares

    death = notes / "death-taas"
    death.unlink(missing_ok=True)
    wait_for_spares(kernel, gpus)
    msg_id, _ = kernel.submit("#pragma taas --gpus auto --restarts 1\n" + DYING.format(death=str(death), settle=settle))
    kernel.wait_for_stream(msg_id, "first-line 1", timeout=300)
    arrived = time.time()
    ran = kernel.collect(msg_id, time.monotonic(), timeout=300)
    if ran.reply["status"] != "ok":
        raise RuntimeError(_plain(ran.error_text()))
    figures.add("restart: death -> line", arrived - float(death.read_text()))
    if with_torchrun:  # without the launch section, whose 30 s windows run it
        add_torchrun_restart(notes, gpus, settle, figures, kernel)


def add_torchrun_restart(notes: Path, gpus: int, settle: float, figures: Figures, kernel: Any) -> None:
    outcome = with_deadline(lambda: torchrun_restart(notes, gpus, settle), spare=kernel)
    if isinstance(outcome, str):
        figures.note("torchrun restart", outcome)
    else:
        figures.add("torchrun restart: death -> line", outcome)


def torchrun_restart(notes: Path, gpus: int, settle: float) -> float:
    """The same under torchrun --max-restarts 1: the death -> the restarted rank 0's own clock at its first line."""
    script, death = notes / "dying.py", notes / "death-torchrun"
    death.unlink(missing_ok=True)
    script.write_text(DYING.format(death=str(death), settle=settle))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(gpus), "--max-restarts", "1", str(script)], capture_output=True, text=True, cwd=notes)
    lines = [line.split() for line in run.stdout.splitlines() if line.startswith("first-line 1 ")]
    if not lines:
        raise RuntimeError(f"no restarted first line (exit {run.returncode})")
    return float(lines[0][2]) - float(death.read_text())


# -- the table ------------------------------------------------------------------------------

