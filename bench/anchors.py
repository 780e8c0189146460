"""The launchers people use today, timed through the same real kernel on the same workload.

Each anchor runs the 50-step 2-rank gloo DDP loop of ``bench/launch.py`` (same MLP, same
batch, rank 0 prints ``first-line`` first thing) the way its documentation says to run it
from a notebook, and is timed like a taas cell: execute_request -> first ``first-line`` on
iopub, and -> execute_reply.

- accelerate's ``notebook_launcher(train, num_processes=2)`` (forks the kernel);
- Lightning's ``Trainer(strategy="ddp_notebook", devices=2)`` (forks the kernel);
- ipyparallel's ``%%px`` on a 2-engine cluster started (and given its DDP environment)
  before the clock starts, as its users keep one running.

An anchor whose package is not installed is reported as such and skipped: they are bench
dependencies only (``pip install accelerate ipyparallel lightning``). Each run of an anchor
goes through :func:`run_with_deadline`: one that raises or passes its deadline becomes a
reason instead of figures (the bench's table prints it as a row), and every process it
started (its kernel, forked ranks, an ipyparallel controller and engines) is killed
afterwards, whatever happened.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable

import psutil

if __name__ == "__main__":  # run as a script: the repository root holds the tests package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernel_client import Kernel

STEPS = 50

# The workload every launcher runs (bench/launch.py and bench/cluster.py build on it too):
# a small DDP MLP, one fixed batch, SGD.
MODEL = """\
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
"""
STEP = """\
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
"""
BODY = (
    "import time, torch, torch.distributed as dist\n"
    'print("first-line", flush=True)\n'
    'dist.init_process_group("gloo", init_method="env://")\n'
    + MODEL + "for i in range({steps}):\n" + STEP + "dist.destroy_process_group()\n"
)

ACCELERATE = (
    "from accelerate import notebook_launcher\n"
    "def train():\n" + textwrap.indent(BODY.format(steps=STEPS), "    ") + "\n"
    "notebook_launcher(train, num_processes=2)\n"
)

LIGHTNING = f"""\
import torch, lightning as L
class MLP(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
data = torch.utils.data.DataLoader([(x, y)] * {STEPS}, batch_size=None)
L.Trainer(accelerator="cpu", devices=2, strategy="ddp_notebook", max_steps={STEPS}, logger=False,
          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
          use_distributed_sampler=False).fit(MLP(), data)
"""

IPYPARALLEL_START = """\
import ipyparallel as ipp, socket
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); _port = s.getsockname()[1]
_cluster = ipp.Cluster(n=2, log_level=40)
_rc = _cluster.start_and_connect_sync(activate=True)
_rc.wait_for_engines(2, timeout=120)
def _ddp_env(rank, port):
    import os
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
for _rank, _engine in enumerate(_rc):
    _engine.apply_sync(_ddp_env, _rank, _port)
_rc[:].execute("import torch, torch.distributed", block=True)
"""
IPYPARALLEL = "%%px\n" + BODY.format(steps=STEPS)
IPYPARALLEL_STOP = "_rc.close(); _cluster.stop_cluster_sync()"


def _time_cell(kernel: Kernel, code: str, first_line: str = "first-line") -> tuple[float, float]:
    msg_id, started = kernel.submit(code)
    ran = kernel.collect(msg_id, started, timeout=300)
    if ran.reply["status"] != "ok":
        raise RuntimeError(ran.error_text())
    first = next(m.at for m in ran.messages if first_line in _text(m.content))
    return first, ran.reply_at


def _text(content: dict) -> str:
    """A stream's text, or the text of a display (ipyparallel shows engine output as displays)."""
    return content.get("text") or content.get("data", {}).get("text/plain", "")


def _fresh_kernel_anchor(cell: str, package: str, first_line: str = "first-line") -> Callable[[str], tuple[float, float]]:
    """An anchor that forks the kernel: a fresh kernel per run with torch and the launcher's
    package imported by an untimed cell, as a notebook's first cells would have (and as
    forking needs, to be fast)."""

    def run(cwd: str) -> tuple[float, float]:
        kernel = Kernel(load_ext=False, cwd=cwd)
        try:
            kernel.execute(f"import torch, torch.distributed, {package}")
            return _time_cell(kernel, cell, first_line)
        finally:
            kernel.shutdown()

    return run


def _ipyparallel(cwd: str) -> tuple[float, float]:
    kernel = Kernel(load_ext=False, cwd=cwd)
    try:
        started = kernel.execute(IPYPARALLEL_START, timeout=180)
        if started.reply["status"] != "ok":
            raise RuntimeError(started.error_text())
        try:
            return _time_cell(kernel, IPYPARALLEL)
        finally:
            kernel.execute(IPYPARALLEL_STOP, timeout=120)
    finally:
        kernel.shutdown()


ANCHORS: dict[str, tuple[str, Callable[[str], tuple[float, float]]]] = {
    "accelerate notebook_launcher": ("accelerate", _fresh_kernel_anchor(ACCELERATE, "accelerate")),
    # Lightning runs no user code in a rank before its own process-group set-up; its first
    # rank-0 line is its own "Initializing distributed: GLOBAL_RANK: 0" log line.
    "lightning ddp_notebook": ("lightning", _fresh_kernel_anchor(LIGHTNING, "lightning", "GLOBAL_RANK: 0")),
    "ipyparallel %%px (running cluster)": ("ipyparallel", _ipyparallel),
}


DEADLINE_SECONDS = 300.0
# Processes an anchor may leave that are no longer our descendants (re-parented when their
# parent died): matched by command line, and only if they started during the anchor's run.
_ORPHAN_MARKERS = ("ipykernel", "ipyparallel", "ipengine", "ipcontroller", "accelerate", "lightning", "torch")


def _gone(process: psutil.Process) -> bool:
    """Exited: no such process, or a zombie (a re-parented one waits for init to reap it)."""
    try:
        if process.status() != psutil.STATUS_ZOMBIE:
            return False
        if process.ppid() == os.getpid():
            process.wait(0)  # our own child: reap it
        return True
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        return True


def _started_during(since: float, before: set[int], markers: tuple[str, ...]) -> list[psutil.Process]:
    me = psutil.Process()
    ours = {p.pid for p in me.children(recursive=True)}
    found = []
    for process in psutil.process_iter(["pid", "uids", "create_time", "cmdline"]):
        info = process.info
        if info["pid"] in before or info["pid"] == me.pid or info["uids"] is None or info["uids"].real != os.getuid():
            continue
        if (info["create_time"] or 0) < since - 1 or _gone(process):
            continue
        cmdline = " ".join(info["cmdline"] or ())
        if info["pid"] in ours or any(marker in cmdline for marker in markers):
            found.append(process)
    return found


def _reap(processes: list[psutil.Process], grace: float = 3.0) -> None:
    """TERM, then KILL what is still there after ``grace`` seconds."""
    for signal_them in (psutil.Process.terminate, psutil.Process.kill):
        for process in processes:
            try:
                signal_them(process)
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + grace
        while processes and time.monotonic() < deadline:
            processes = [process for process in processes if not _gone(process)]
            time.sleep(0.05)


def run_with_deadline(name: str, run: Callable[[str], tuple[float, float]], cwd: str, deadline: float = DEADLINE_SECONDS,
                      markers: tuple[str, ...] = _ORPHAN_MARKERS) -> tuple[float, float] | str:
    """One run of an anchor: its (first line, whole) seconds, or why there are none (it raised,
    or it passed ``deadline``). Every process it started is gone when this returns: its descendants,
    and the processes of this user started meanwhile whose command line holds one of ``markers``
    (orphans re-parented away; the bench runs alone, the tests name markers of their own)."""
    before = set(psutil.pids())
    since = time.time()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["figures"] = run(cwd)
        except BaseException as exc:  # noqa: BLE001 - any failure of an anchor is a row, not the end of the bench
            outcome["error"] = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:160]

    thread = threading.Thread(target=target, name=f"anchor {name}", daemon=True)
    thread.start()
    thread.join(deadline)
    _reap(_started_during(since, before, markers))
    if thread.is_alive():
        return f"hung past its {deadline:.0f} s deadline (stopped)"
    if "figures" in outcome:
        return outcome["figures"]
    return f"failed: {outcome['error']}"


def available() -> dict[str, Callable[[str], tuple[float, float]]]:
    """The anchors whose package is installed here, by name."""
    found = {}
    for name, (package, run) in ANCHORS.items():
        if importlib.util.find_spec(package) is None:
            print(f"[bench] {name}: skipped, {package} is not installed")
        else:
            found[name] = run
    return found


if __name__ == "__main__":  # one run of each, for a quick check
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name, run in available().items():
            began = time.monotonic()
            outcome = run_with_deadline(name, run, tmp)
            if isinstance(outcome, str):
                print(f"{name:<36} {outcome} ({time.monotonic() - began:.1f} s)")
            else:
                first, whole = outcome
                print(f"{name:<36} first line {first:.3f} s, whole {whole:.3f} s ({time.monotonic() - began:.1f} s)")
