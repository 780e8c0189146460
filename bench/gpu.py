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
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 1 << 30
DEADLINE_SECONDS = 180.0  # a torchrun run or a floor: past it, what it started is killed
SECTIONS = ("launch", "transfer", "throughput", "reports", "restart")

LAUNCH = """\
import os, time, torch, torch.distributed as dist
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
if os.environ["RANK"] == "0":
    print("first-line", flush=True)
dist.init_process_group("nccl", init_method="env://")
_flag = torch.ones(1, device="cuda")
dist.all_reduce(_flag)
torch.cuda.synchronize()
if os.environ["RANK"] == "0":
    print("reduced", int(_flag.item()), flush=True)
del _flag
dist.destroy_process_group()
"""

MODEL = """\
import os, time, torch, torch.distributed as dist
local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl", init_method="env://")
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, dim_feedforward=2048, dropout=0.0, batch_first=True)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.TransformerEncoder(layer, num_layers=12, enable_nested_tensor=False).cuda(), device_ids=[local])
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn(32, 256, 512, device="cuda")

def train_step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    return loss

for _ in range(10):
    train_step()
torch.cuda.synchronize()
"""

THROUGHPUT = MODEL + """\
started = time.perf_counter()
for _ in range({steps}):
    train_step()
torch.cuda.synchronize()
if dist.get_rank() == 0:
    print(f"steps_per_sec {{{steps} / (time.perf_counter() - started):.3f}}", flush=True)
del model, opt, x, layer, train_step  # nothing big comes back to the notebook after each run
dist.destroy_process_group()
"""

REPORTS = MODEL + """\
import taas

def loop(way):
    torch.cuda.synchronize()
    started = time.perf_counter()
    for step in range({steps}):
        loss = train_step()
        if way == "report":
            taas.report(step=step, loss=loss)
        elif way == "item":
            loss.item()
    torch.cuda.synchronize()
    return time.perf_counter() - started

ratios, bare_times = {{"report": [], "item": []}}, []
for pair in range({repeats}):
    for way in ratios:
        if pair % 2 == 0:  # ABBA: neither side always first
            bare, other = loop("bare"), loop(way)
        else:
            other, bare = loop(way), loop("bare")
        ratios[way].append(other / bare)
        bare_times.append(bare / {steps})
figures = (ratios, bare_times)
del model, opt, x, layer, train_step, loop
dist.destroy_process_group()
"""

DYING = """\
import os, signal, time, torch, torch.distributed as dist
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
if os.environ["RANK"] == "0":
    print(f"first-line {{attempt}} {{time.time():.6f}}", flush=True)
dist.init_process_group("nccl", init_method="env://")
_flag = torch.ones(1, device="cuda")
dist.all_reduce(_flag)
torch.cuda.synchronize()
if attempt == 0:
    time.sleep({settle})  # the attempt runs a while first (taas readies the restart's spares meanwhile)
    if dist.get_rank() == dist.get_world_size() - 1:
        open({death!r}, "w").write(f"{{time.time():.6f}}")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
del _flag
dist.destroy_process_group()
"""

# The floors of moving 1 GiB, in a plain process: through host memory (the tensor copied to
# ordinary host memory, then back) and device to device (one copy on the same GPU).
FLOORS = """\
import json, statistics, sys, time, torch
size, repeats = int(sys.argv[1]), int(sys.argv[2])
source = torch.ones(size // 4, device="cuda")
target = torch.empty_like(source)
torch.cuda.synchronize()
times = {"d2h+h2d": [], "d2d": []}
for _ in range(repeats + 1):  # the first of each warms up, and is dropped
    started = time.perf_counter()
    host = source.cpu()
    back = host.cuda()
    torch.cuda.synchronize()
    times["d2h+h2d"].append(time.perf_counter() - started)
    del host, back
    started = time.perf_counter()
    target.copy_(source)
    torch.cuda.synchronize()
    times["d2d"].append(time.perf_counter() - started)
print(json.dumps({"times": {k: v[1:] for k, v in times.items()}, "gpu": torch.cuda.get_device_name(0),
                  "gpus": torch.cuda.device_count(), "cuda": torch.version.cuda, "torch": torch.__version__}))
"""

PROBE = ("import os, torch\n"
         "_rss = dict(line.split(':', 1) for line in open('/proc/self/status') if line.startswith('Rss'))\n"
         "print('{word}', os.getpid(), int(_rss['RssAnon'].split()[0]) * 1024, torch.cuda.memory_allocated(), "
         "torch.cuda.max_memory_allocated(), {device}, flush=True)\n")
RESULT_CELL = ("#pragma taas --gpus auto\nimport os, torch\n"
               f"result = torch.ones({GIB // 4}, device='cuda') if os.environ['RANK'] == '0' else None\n"
               "torch.cuda.synchronize()\n" + PROBE.format(word="last", device="'-'"))
CLOSURE_CELL = "#pragma taas --gpus auto\n" + PROBE.format(word="first", device="captured.device") + "n = captured.numel()\n"
EMPTY_CELL = "#pragma taas --gpus auto\n" + PROBE.format(word="first", device="'-'")


def cuda_or_skip() -> int:
    """The GPUs torch sees here; where there is none, one line and exit 0."""
    import torch

    if not torch.cuda.is_available():
        print(f"bench/gpu.py: skipped, torch {torch.__version__} sees no CUDA GPU here "
              f"(CUDA build: {torch.version.cuda or 'none'}); nothing measured")
        sys.exit(0)
    return torch.cuda.device_count()


class Figures:
    """Every measurement by name, and why a part has none (a failed section, a hung torchrun)."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}
        self.notes: dict[str, list[str]] = {}

    def add(self, name: str, value: float) -> None:
        self.values.setdefault(name, []).append(value)

    def note(self, name: str, why: str) -> None:
        self.notes.setdefault(name, []).append(why)

    def median(self, name: str) -> float:
        values = self.values.get(name)
        return statistics.median(values) if values else float("nan")


def with_deadline(run: Callable[[], Any], deadline: float = DEADLINE_SECONDS, spare: Any = None) -> Any:
    """``run()``'s value, or why there is none (it raised, or passed ``deadline``): anchors.run_with_deadline,
    sparing ``spare``'s processes (a kernel: its warm spares may start while the anchor runs)."""
    import psutil

    from bench import anchors

    before, since, outcome = set(psutil.pids()), time.time(), {}

    def target() -> None:
        try:
            outcome["value"] = run()
        except BaseException as exc:  # noqa: BLE001 - any failure of an anchor is a row, not the end of the bench
            outcome["error"] = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:160]

    thread = threading.Thread(target=target, name="gpu anchor", daemon=True)
    thread.start()
    thread.join(deadline)
    kept: set[int] = set()
    if spare is not None:
        try:
            kept = {spare.pid} | {p.pid for p in psutil.Process(spare.pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    anchors._reap([p for p in anchors._started_during(since, before) if p.pid not in kept])
    if thread.is_alive():
        return f"hung past its {deadline:.0f} s deadline (stopped)"
    return outcome["value"] if "value" in outcome else f"failed: {outcome['error']}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def timed_lines(proc: subprocess.Popen, started: float) -> dict[str, tuple[float, str]]:
    """For each first word, seconds from ``started`` to the first line starting with it, and that
    line, read from ``proc``'s stdout."""
    seen: dict[str, tuple[float, str]] = {}
    for line in proc.stdout:  # type: ignore[union-attr]
        words = line.split()
        if words:
            seen.setdefault(words[0], (time.monotonic() - started, line.strip()))
    if proc.wait() != 0:
        raise RuntimeError(f"exited with {proc.returncode}; saw {sorted(seen)}")
    return seen


def floor_launch(script: Path, gpus: int) -> dict[str, tuple[float, str]]:
    """N plain processes started at once with the DDP environment (no launcher at all)."""
    port, started = free_port(), time.monotonic()
    procs = []
    for rank in range(gpus):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(gpus),
               "LOCAL_WORLD_SIZE": str(gpus), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True, cwd=script.parent,
                                      stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    seen = timed_lines(procs[0], started)
    for proc in procs[1:]:
        proc.wait()
    return seen


def torchrun(script: Path, gpus: int, *extra: str) -> dict[str, tuple[float, str]]:
    """torchrun --standalone over the GPUs: rank 0's lines as they arrive (only rank 0 prints)."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(gpus), *extra, str(script)], cwd=script.parent, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return timed_lines(proc, started)


def _plain(text: str) -> str:
    """A traceback's last line, without IPython's colours."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", text).strip().splitlines()
    return lines[-1] if lines else "no error text"


def run_cell(kernel: Any, code: str, timeout: float = 600) -> Any:
    msg_id, started = kernel.submit(code)
    ran = kernel.collect(msg_id, started, timeout=timeout)
    if ran.reply["status"] != "ok":
        raise RuntimeError(_plain(ran.error_text()))
    return ran


def arrival(ran: Any, word: str) -> float:
    return next(m.at for m in ran.messages if m.type == "stream" and word in m.content["text"])


# -- launch ---------------------------------------------------------------------------------

def taas_launch(kernel: Any, figures: Figures, when: str) -> str:
    """One LAUNCH cell: its first line and its all_reduce, as ``when``; returns its header line."""
    ran = run_cell(kernel, "#pragma taas --gpus auto\n" + LAUNCH)
    figures.add(f"{when}: first line", arrival(ran, "first-line"))
    figures.add(f"{when}: all_reduce done", arrival(ran, "reduced"))
    return ran.stream("stdout").splitlines()[0]


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
