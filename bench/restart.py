"""How fast a lost rank is replaced, and what a durable checkpoint costs, beside torchrun and torch.save.

    python bench/restart.py [--repeats 5] [--megabytes 100]

Measured in one run, side by side:

- restart: a 2-rank cell with ``--restarts 1`` whose rank 1 notes the time and SIGKILLs
  itself; the figure is the time from that death to the restarted attempt's first rank-0
  line arriving on iopub (what the person sees), through a real kernel, with warm spares
  (the default: taas keeps a restart's processes warm while the attempt runs) and without
  (``%taas warm off``). Beside it, torchrun ``--max-restarts 1`` with the same script: death
  to the restarted rank 0's first line, as that rank prints its own clock (which favours
  torchrun: no pipe, no notebook). Floor: the kernel noticing the death and starting
  nothing (a ``--restarts 0`` cell's death to its error reply).
- checkpoint: ``taas.save_checkpoint`` of a state of --megabytes (temporary file, fsync,
  rename, folder fsync, the oldest removed) beside a plain ``torch.save`` to the same disk
  (not durable: the bytes may still be in the page cache) and, as the floor of a durable
  save, ``torch.save`` then ``fsync``; in ABC/CBA order, each after an ``os.sync()``.
- autopsy: reading two hung ranks' stacks (stacks.take, the signal and the dumps), which
  is what the autopsy adds to a stop.

Medians of --repeats runs; ratios are of medians measured in this run.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.kernel_client import Kernel  # noqa: E402

DYING = """\
import os, signal, time, torch.distributed as dist
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if os.environ["RANK"] == "0":
    print(f"first-line {{attempt}} {{time.time():.6f}}", flush=True)
dist.init_process_group("gloo", init_method="env://")
if attempt == 0:
    time.sleep({settle})  # the attempt runs a while first (taas readies the restart's spares meanwhile)
    if dist.get_rank() == 1:
        open({death!r}, "w").write(f"{{time.time():.6f}}")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
dist.destroy_process_group()
"""


def taas_restart(kernel: Kernel, death: Path, settle: float) -> float:
    """Seconds from rank 1's death to the restarted attempt's first rank-0 line on iopub."""
    death.unlink(missing_ok=True)
    msg_id, _ = kernel.submit("#pragma taas --gpus 2 --restarts 1\n" + DYING.format(death=str(death), settle=settle))
    kernel.wait_for_stream(msg_id, "first-line 1", timeout=120)
    arrived = time.time()
    ran = kernel.collect(msg_id, time.monotonic())
    assert ran.reply["status"] == "ok", ran.error_text()
    return arrived - float(death.read_text())


def taas_no_restart(kernel: Kernel, death: Path) -> float:
    """The floor: a --restarts 0 cell, from the death to its error reply (the kernel saw it and stopped)."""
    death.unlink(missing_ok=True)
    ran = kernel.execute("#pragma taas --gpus 2\n" + DYING.format(death=str(death), settle=0.5))
    replied = time.time()
    assert ran.reply["status"] == "error"
    return replied - float(death.read_text())


def torchrun_restart(folder: Path, settle: float) -> float | None:
    """Death to the restarted rank 0's first line under torchrun; None if its restart hung (stopped after 60 s)."""
    script, death = folder / "dying.py", folder / "death-torchrun"
    death.unlink(missing_ok=True)
    script.write_text(DYING.format(death=str(death), settle=settle))
    try:
        ran = _torchrun(script, folder)
    except subprocess.TimeoutExpired:
        return None
    lines = [line.split() for line in ran.stdout.splitlines() if line.startswith("first-line 1 ")]
    assert lines, ran.stdout + ran.stderr
    return float(lines[0][2]) - float(death.read_text())


def _torchrun(script: Path, folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        # --standalone: the c10d rendezvous (torchrun's static one, --master-port, does not restart
        # gloo here: the restarted ranks find the old attempt's addresses in the store)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--max-restarts", "1", str(script)],
        capture_output=True, text=True, timeout=60, cwd=folder,
    )


def _sweep_torchrun_ranks(folder: Path) -> None:
    """A hung torchrun was killed (subprocess.run's timeout); its ranks go too."""
    import psutil

    for process in psutil.process_iter(["cmdline"]):
        if str(folder / "dying.py") in " ".join(process.info["cmdline"] or []):
            process.kill()


def checkpoint_costs(megabytes: int, repeats: int) -> dict[str, list[float]]:
    import torch

    from taas_magic.writes import checkpoints

    state = {"weights": torch.randn(megabytes * (1 << 20) // 4), "step": 7}
    times: dict[str, list[float]] = {"save_checkpoint": [], "torch.save": [], "torch.save + fsync": []}
    with tempfile.TemporaryDirectory(dir=os.getcwd()) as folder:  # the disk a repository is on
        def durable_save() -> None:
            with open(os.path.join(folder, "durable.pt"), "wb") as file:
                torch.save(state, file)
                file.flush()
                os.fsync(file.fileno())

        ways = {
            "save_checkpoint": lambda: checkpoints.save(state, os.path.join(folder, "run"), keep=2),
            "torch.save": lambda: torch.save(state, os.path.join(folder, "plain.pt")),
            "torch.save + fsync": durable_save,
        }
        for repeat in range(repeats):
            names = list(ways) if repeat % 2 == 0 else list(reversed(ways))  # ABC CBA: no way always goes first
            for name in names:
                os.sync()  # each starts with nothing dirty: one way's write-back is not another's fsync
                started = time.perf_counter()
                ways[name]()
                times[name].append(time.perf_counter() - started)
    return times


HUNG_RANK = """\
import sys, time
from taas_magic.autopsy import dump
dump.arm(sys.argv[1])
def waiting():
    time.sleep(300)
waiting()
"""


def autopsy_seconds(repeats: int) -> list[float]:
    from taas_magic.autopsy import stacks

    with tempfile.TemporaryDirectory() as folder:
        paths = [os.path.join(folder, f"rank-{rank}") for rank in range(2)]
        ranks = [subprocess.Popen([sys.executable, "-c", HUNG_RANK, path], cwd=ROOT) for path in paths]
        try:
            deadline = time.monotonic() + 30
            while not all(os.path.exists(path) and os.path.getsize(path) for path in paths):
                assert time.monotonic() < deadline, "the hung ranks never armed"
                time.sleep(0.05)
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                dumps = stacks.take({rank: (process.pid, paths[rank]) for rank, process in enumerate(ranks)})
                times.append(time.perf_counter() - started)
                assert all("in waiting" in dump for dump in dumps.values()), dumps
            return times
        finally:
            for process in ranks:
                process.kill()
                process.wait()


def row(name: str, values: list[float], floor: str, beside: str) -> str:
    median = statistics.median(values)
    return f"{name:<38} {median:8.3f} s {min(values):8.3f} {max(values):8.3f}  {floor:<26} {beside}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--megabytes", type=int, default=100)
    parser.add_argument("--settle", type=float, default=5.0, help="seconds attempt 0 runs before the death")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="taas-bench-restart-"))  # the death notes: outside the repository,
    warm, cold, floor, torchrun = [], [], [], []  # where rank 1's writes would be diverted (the write rule)
    hung = 0  # torchrun restarts that never reached their first line
    kernel = Kernel(cwd=str(ROOT))
    try:
        kernel.execute(f"%config TaasMagics.checkpoint_dir = {str(folder / 'checkpoints')!r}")
        kernel.execute("#pragma taas --gpus 2\npass")  # the first cell pays the imports; spares follow it
        for _ in range(args.repeats):
            warm.append(taas_restart(kernel, folder / "death-warm", args.settle))
            floor.append(taas_no_restart(kernel, folder / "death-floor"))
            torchrun_seconds = torchrun_restart(folder, args.settle)
            if torchrun_seconds is None:
                hung += 1
                _sweep_torchrun_ranks(folder)
            else:
                torchrun.append(torchrun_seconds)
        kernel.execute("%taas warm off")
        for _ in range(args.repeats):
            cold.append(taas_restart(kernel, folder / "death-cold", args.settle))
    finally:
        kernel.shutdown()
    saves = checkpoint_costs(args.megabytes, args.repeats)
    autopsies = autopsy_seconds(args.repeats)
    m = statistics.median
    tr = m(torchrun) if torchrun else float("nan")
    print(f"bench/restart.py: {args.repeats} runs each, medians (min, max); 2 ranks, gloo, {os.cpu_count()} cores")
    print(f"{'figure':<38} {'median':>10} {'min':>8} {'max':>8}  {'floor / target':<26} beside")
    print(row("restart, warm spares: death->line", warm, "target <= 1 s",
              f"torchrun {tr:.3f} s: {m(warm) / tr:.2f}x"))
    print(row("restart, fresh processes: death->line", cold, "",
              f"torchrun {tr:.3f} s: {m(cold) / tr:.2f}x"))
    print(row("no restart: death->error reply", floor, "(the floor of noticing)", ""))
    print(row("torchrun --max-restarts 1: death->line", torchrun or [float("nan")], "",
              f"{hung} of {args.repeats} torchrun restarts hung (stopped after 60 s)"))
    plain, durable = m(saves["torch.save"]), m(saves["torch.save + fsync"])
    print(row(f"save_checkpoint {args.megabytes} MB", saves["save_checkpoint"],
              f"floor fsync'd {durable:.3f} s: {m(saves['save_checkpoint']) / durable:.2f}x",
              f"torch.save {plain:.3f} s: {m(saves['save_checkpoint']) / plain:.2f}x"))
    print(row(f"torch.save {args.megabytes} MB (not durable)", saves["torch.save"], "", ""))
    print(row(f"torch.save + fsync {args.megabytes} MB", saves["torch.save + fsync"], "", ""))
    print(row("autopsy of 2 hung ranks (stacks.take)", autopsies, "target: adds <= 2 s", ""))


if __name__ == "__main__":
    main()
