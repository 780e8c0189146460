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
dependencies only (``pip install accelerate ipyparallel lightning``).
"""

from __future__ import annotations

import importlib.util
import textwrap
import time
from typing import Callable

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
            first, whole = run(tmp)
            print(f"{name:<36} first line {first:.3f} s, whole {whole:.3f} s ({time.monotonic() - began:.1f} s)")
