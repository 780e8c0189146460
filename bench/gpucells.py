"""bench/gpu.py's cells and scripts, and the helpers every round shares: timed lines, deadlines, the floors.

Read bench/gpu.py's docstring for what is measured; this module only holds its parts.
"""

from __future__ import annotations

import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

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
    anchors._reap([p for p in anchors._started_during(since, before, anchors._ORPHAN_MARKERS) if p.pid not in kept])
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


