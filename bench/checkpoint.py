"""What a collective checkpoint costs in a taas cell: DCP's save from 2 ranks, beside torchrun.

    python bench/checkpoint.py [--repeats 5] [--big-repeats 5] [--sizes 50,500] [--layouts fsdp,replicated]

Every rank of a 2-rank job saves ``dcp.save({"model": model.state_dict()}, checkpoint_id=...)``
of an ``nn.Sequential`` of ``Linear(2048, 2048)`` layers (16 MB each), as many as come nearest to
--sizes MB of fp32 parameters (50: 48 MB, 500: 496 MB), laid out two ways:

- ``fsdp``: FSDP2's ``fully_shard`` per layer on a CPU mesh of 2, so each rank holds and writes
  half (``__0_0.distcp`` and ``__1_0.distcp`` about equal);
- ``replicated``: the plain module on every rank, as DDP holds it; DCP's planner deduplicates the
  replicas and spreads the writes over the ranks.

The same script runs three ways, side by side in one run:

- a taas cell (``#pragma taas --device cpu --gpus 2``) through a real kernel, in the default
  isolation mode (``auto``: the overlay here, checked from the run's header), saving into a
  folder of the repository (a scratch one, ``%taas config repo``): rank 1's writes would be
  diverted, and since f099d8e its DCP folder is bind-mounted in place instead;
- the same cell with ``%taas config isolation python`` (the Python layer passes the folder through);
- plain ``torchrun --standalone --nproc-per-node 2`` of the script, saving into a scratch folder
  on the same filesystem (both under the system's temp dir; the bench prints which filesystem).

Each way starts a fresh job per save, in ABC/CBA order per repeat so no way always goes first,
and only once the kernel and everything it started have been idle for half a second (the spares
it makes after a cell would otherwise land on the next save, whichever way's it is). In each
rank: build the model (meta device, then filled: the contents do not change the bytes written),
``os.sync()`` (nothing dirty from the last save), a barrier, then only ``dcp.save`` is timed
(``perf_counter``; and ``process_time``, the CPU of all the rank's threads); the figure is the
slowest rank's. Process start, imports and the kernel's check of the folder after the cell are
not counted. DCP's writer fsyncs each file, so a save is as durable in all three ways. A
checkpoint counts only once the bench has found it whole (``.metadata``, ``__0_0.distcp``,
``__1_0.distcp``, none empty, and no "incomplete" from the kernel); it is then deleted, so the
disk holds one at a time.

Figures: medians (min, max) of --repeats saves (--big-repeats for 200 MB and more), the median of
the per-repeat ratios taas / torchrun (target: at most 1.1x), the CPU seconds of the busiest rank
in the save with their paired ratio (what taas adds to the save's work, which other processes on
the host disturb far less than its wall time), and each rank's peak memory during the save over
its memory before it (``VmHWM`` reset before the barrier).

Copies of the data on the host at the peak, the same in all three ways (no way stages a copy:
DCP writes each CPU tensor's storage from the rank's memory; the overlay is not in the path, as
the folder is bind-mounted over it; the Python layer passes the folder's opens through):

- ``fsdp``: one copy in the ranks (each holds its half), plus the checkpoint in the page cache
  (clean after the fsync, kept until memory is wanted): 2 copies.
- ``replicated``: one copy in each rank (2), plus the page cache: 3 copies.

The "peak - before" column checks the first point: a rank's memory grows by 5 to 21 MB during
the save, less than one layer (16 MB) beyond its buffers, where a staging copy would be its whole
part (248 or 496 MB). A taas rank's grows 4 to 10 MB more than a torchrun rank's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from tests.kernel_client import Kernel  # noqa: E402

WAYS = ("taas overlay", "taas python", "torchrun")
MODES = {"taas overlay": "auto", "taas python": "python"}
HEADERS = {"taas overlay": "diverted (overlay)", "taas python": "diverted by Python"}
PARTS = [".metadata", "__0_0.distcp", "__1_0.distcp"]

SCRIPT = """\
import os, time, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp

def _kib(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))

def _dcp_bench(folder, megabytes, layout, width=2048):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layers = max(1, round(megabytes * 2**20 / (4 * (width * width + width))))
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    if layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in model.state_dict().values():
            (tensor.to_local() if hasattr(tensor, "to_local") else tensor).fill_(0.5)
    state = {{"model": model.state_dict()}}
    held = sum((t.to_local() if hasattr(t, "to_local") else t).numel() * 4 for t in state["model"].values())
    os.sync()  # nothing dirty left by the last save: its write-back is not this one's
    rss = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM from here on: the peak of the save, not of the model's making
    dist.barrier()
    started, cpu = time.perf_counter(), time.process_time()
    dcp.save(state, checkpoint_id=folder)
    figures = torch.tensor([time.perf_counter() - started, (_kib("VmHWM") - rss) * 1024.0, held,
                            time.process_time() - cpu], dtype=torch.float64)
    gathered = [torch.zeros(4, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(gathered, figures)
    if rank == 0:
        print("dcp-save", " ".join(f"{{value:.6f}}" for row in gathered for value in row.tolist()), flush=True)
    del model, state
    dist.destroy_process_group()

_dcp_bench({folder!r}, {megabytes}, {layout!r})
del _dcp_bench, _kib
"""


class Result:
    """One save: the slowest rank's seconds, each rank's peak memory over its memory before, each rank's MB
    held, and the most CPU seconds a rank spent in it (all its threads)."""

    def __init__(self, line: str):
        values = [float(word) for word in line.split()[1:]]
        self.seconds = max(values[0], values[4])
        self.peak_mb = [values[1] / 2**20, values[5] / 2**20]
        self.held_mb = [values[2] / 2**20, values[6] / 2**20]
        self.cpu = max(values[3], values[7])
        self.megabytes = 0.0  # the checkpoint's, on disk


def _parse(output: str) -> Result:
    lines = [line for line in output.splitlines() if line.startswith("dcp-save ")]
    assert lines, output
    return Result(lines[-1])


def _whole(folder: Path, said: str, result: Result) -> Result:
    """The checkpoint counts only if every part is there (its size is noted); then it is deleted."""
    found = sorted(os.listdir(folder)) if folder.is_dir() else []
    assert found == PARTS, f"{folder}: {found}\n{said}"
    sizes = [(folder / part).stat().st_size for part in PARTS]
    assert all(sizes), list(zip(PARTS, sizes))
    result.megabytes = sum(sizes) / 2**20
    shutil.rmtree(folder)
    return result


class Ways:
    """The three ways, each saving into its own scratch folder."""

    def __init__(self, scratch: Path):
        self.repo, self.plain = scratch / "repo", scratch / "torchrun"
        (self.repo / ".git").mkdir(parents=True)
        self.plain.mkdir()
        self.kernel = Kernel(cwd=str(self.repo))
        self.mode = ""
        self.count = 0
        self.outside_kills = 0  # torchruns signalled by another process before saving: made again
        self.exit_aborts = 0  # torchruns whose rank aborted at exit, after a whole save
        self.unsettled = 0  # saves started with the kernel still busy after settle()'s timeout
        ran = self.kernel.execute(f"%taas config repo {self.repo}")
        assert ran.reply["status"] == "ok", ran.stream()

    def save(self, way: str, megabytes: int, layout: str) -> Result:
        self.count += 1
        if way != "torchrun" and self.mode != MODES[way]:
            ran = self.kernel.execute(f"%taas config isolation {MODES[way]}")
            assert ran.reply["status"] == "ok", ran.stream()
            self.mode = MODES[way]
        self.settle()
        if way == "torchrun":
            return self._torchrun(megabytes, layout)
        return self._taas(way, megabytes, layout)

    def _taas(self, way: str, megabytes: int, layout: str) -> Result:
        folder = self.repo / f"ckpt-{self.count}"
        ran = self.kernel.execute("#pragma taas --device cpu --gpus 2\n"
                                  + SCRIPT.format(folder=str(folder), megabytes=megabytes, layout=layout), timeout=600)
        said = ran.stream() + ran.error_text()
        assert ran.reply["status"] == "ok", said
        assert HEADERS[way] in ran.stream("stdout"), said  # the isolation this way names, not a fallback
        assert "incomplete" not in ran.stream("stderr"), said
        return _whole(folder, said, _parse(ran.stream("stdout")))

    def _torchrun(self, megabytes: int, layout: str) -> Result:
        folder = self.plain / f"ckpt-{self.count}"
        script = self.plain / "save.py"
        script.write_text(SCRIPT.format(folder=str(folder), megabytes=megabytes, layout=layout))
        for _ in range(3):
            ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                  str(script)], capture_output=True, text=True, timeout=600, cwd=self.plain)
            said = f"exit {ran.returncode}\n{ran.stdout}{ran.stderr}"
            if "dcp-save " in ran.stdout or not (ran.returncode < 0 or "SIGTERM" in ran.stderr):
                break
            # IMPORTANT: torchrun was sent SIGTERM before any save (it dies, or passes it to its ranks): not the
            # save's doing, but another process's on this host (bench/anchors.py's sweep, which tests/unit runs,
            # ends every process of this user started in its window whose command line names torch). Made again.
            self.outside_kills += 1
            shutil.rmtree(folder, ignore_errors=True)
        if ran.returncode != 0:
            # torch 2.13 on this host: now and then rank 1 aborts as its interpreter exits, after its save and
            # its result ("terminate called without an active exception"); the save is whole all the same
            assert "dcp-save " in ran.stdout and "terminate called" in ran.stderr, said
            self.exit_aborts += 1
        return _whole(folder, said, _parse(ran.stdout))

    def settle(self, window: float = 0.5, most: float = 0.05, timeout: float = 60) -> None:
        """Wait until the kernel and its processes are idle (under ``most`` of a core over ``window``).

        IMPORTANT: after a cell, and after ``%taas config isolation`` (a new spare factory), the kernel
        makes the next cell's spares: imports and a first training step, a core's worth of CPU for a
        second or more. Unsettled, that lands on whichever save comes next (a torchrun's, as often as
        not), and on 2 cores it is as large as the difference measured."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            before = _cpu_seconds(self.kernel)
            time.sleep(window)
            after = _cpu_seconds(self.kernel)
            if sum(spent - before.get(pid, 0.0) for pid, spent in after.items()) < most * window:
                return
        self.unsettled += 1

    def close(self) -> None:
        self.kernel.shutdown()


def _cpu_seconds(kernel: Kernel) -> dict[int, float]:
    """CPU seconds so far of the kernel and each of its descendants, by pid."""
    spent = {}
    try:
        processes = [psutil.Process(kernel.pid), *psutil.Process(kernel.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return spent
    for process in processes:
        try:
            times = process.cpu_times()
            spent[process.pid] = times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return spent


def _filesystem(path: Path) -> str:
    ran = subprocess.run(["df", "--output=fstype,source", str(path)], capture_output=True, text=True)
    return " ".join(ran.stdout.split()[2:]) if ran.returncode == 0 else "?"


def measure(ways: Ways, cases: list[tuple[int, str, int]]) -> dict[tuple[int, str], dict[str, list[Result]]]:
    results: dict[tuple[int, str], dict[str, list[Result]]] = {}
    for megabytes, layout, repeats in cases:
        each = results[(megabytes, layout)] = {way: [] for way in WAYS}
        ways.save("taas overlay", megabytes, layout)  # not counted: the first cell of a case warms its imports
        for repeat in range(repeats):
            for way in (WAYS if repeat % 2 == 0 else tuple(reversed(WAYS))):  # ABC CBA
                each[way].append(ways.save(way, megabytes, layout))
            print(f"  {megabytes} MB {layout} repeat {repeat + 1}/{repeats}: "
                  + ", ".join(f"{way} {each[way][-1].seconds:.3f} s" for way in WAYS), flush=True)
    return results


def table(results: dict[tuple[int, str], dict[str, list[Result]]]) -> list[str]:
    m = statistics.median
    lines = [f"{'figure':<34} {'median':>9} {'min':>7} {'max':>7}  {'target':<26} {'beside torchrun':<30} "
             f"{'CPU s (paired)':<16} peak - before"]
    for (megabytes, layout), each in results.items():
        plain = m([r.seconds for r in each["torchrun"]])
        held, size = each["torchrun"][0].held_mb, each["torchrun"][0].megabytes
        lines.append(f"{megabytes} MB, {layout}: a checkpoint of {size:.0f} MB (rank 0 holds {held[0]:.0f} MB, "
                     f"rank 1 {held[1]:.0f} MB), {len(each['torchrun'])} runs:")
        for way in WAYS:
            seconds = [r.seconds for r in each[way]]
            peaks = max(p for r in each[way] for p in r.peak_mb)
            median = m(seconds)
            cpu = f"{m([r.cpu for r in each[way]]):.3f}"
            if way == "torchrun":
                target, beside = "(the floor)", f"{size / median:.0f} MB/s"
            else:
                paired = m([a.seconds / b.seconds for a, b in zip(each[way], each["torchrun"])])
                target = f"<= 1.1x: {'met' if paired <= 1.1 else 'NOT met'}"
                beside = f"{plain:.3f} s: {median / plain:.2f}x, paired {paired:.2f}x"
                cpu += f" ({m([a.cpu / b.cpu for a, b in zip(each[way], each['torchrun'])]):.2f}x)"
            lines.append(f"  {way + ' dcp.save':<32} {median:7.3f} s {min(seconds):7.3f} {max(seconds):7.3f}  "
                         f"{target:<26} {beside:<30} {cpu:<16} {peaks:6.0f} MB")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--big-repeats", type=int, default=5, help="repeats of the sizes of 200 MB and more")
    parser.add_argument("--sizes", default="50,500", help="MB of fp32 parameters, comma-separated")
    parser.add_argument("--layouts", default="fsdp,replicated", help="fsdp and/or replicated")
    args = parser.parse_args()
    cases = [(int(size), layout, args.big_repeats if int(size) >= 200 else args.repeats)
             for size in args.sizes.split(",") for layout in args.layouts.split(",")]
    scratch = Path(tempfile.mkdtemp(prefix="taas-bench-checkpoint-"))
    began, load = time.monotonic(), os.getloadavg()[0]
    ways = Ways(scratch)
    try:
        results = measure(ways, cases)
    finally:
        ways.close()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"bench/checkpoint.py: DCP save from 2 ranks (gloo, {os.cpu_count()} cores), medians (min, max) of the "
          f"slowest rank's dcp.save; ratios: median of the per-repeat taas/torchrun; {_filesystem(scratch.parent)}; "
          f"{time.monotonic() - began:.0f} s in all; load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")
    print("\n".join(table(results)))
    print(f"torchrun: {ways.exit_aborts} run(s) whose rank aborted at exit after a whole save (counted); "
          f"{ways.outside_kills} killed from outside before saving (made again); "
          f"{ways.unsettled} save(s) started with the kernel still busy after 60 s")


if __name__ == "__main__":
    main()
