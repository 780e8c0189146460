"""Moving tensors across the boundary, both ways, beside the floor and the commit before.

    python bench/transfer.py [--repeats 3] [--sizes 50,200,1000] [--baseline de49127]

Through a real kernel (jupyter_client), warm cells, one rank. For each size (MB) and
shape (one big float32 tensor; a state dict of 1 MB tensors):

- closure -> first line: the notebook holds the tensors (untimed); a taas cell that
  reads them prints a line first thing. Time from execute_request to that line on iopub;
  beside it the same cell capturing nothing, which is the launch alone; and that line to
  the reply, which is what rank 0 spends finding the captured tensors untouched.
- last line -> names bound: rank 0 makes the tensors, prints a line, and ends. Time
  from that line's arrival to the reply (the names are bound by then).
- floor: ``torch.save`` then ``torch.load`` of the same tensors through ``/dev/shm`` in
  one process: writing and reading the bytes once each.
- memory: the kernel's peak growth (anonymous, shared and file-backed resident pages,
  each kind's growth added, sampled every 5 ms from /proc) while it receives, as a multiple of the results'
  size; the rank's private (anonymous) memory and its resident shared-memory pages
  (the mapped closure file) at its first line, beyond those of the same rank capturing
  nothing, as multiples of the closure's size.
- before: the same cells in a kernel running the code of ``--baseline`` (a git
  worktree, the kernel's working directory and first on its PYTHONPATH, so its ranks
  run that code too).

Medians of --repeats; every figure is measured in this run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.launch import wait_for_spares  # noqa: E402
from tests.kernel_client import Kernel  # noqa: E402

BASELINE = "de49127"  # the commit before results and closures moved to segments and memory files
MB = 1 << 20
SHAPES = ("tensor", "state dict")

RSS_FIELDS = ("RssAnon", "RssFile", "RssShmem")


def _make(shape: str, size_mb: int) -> str:
    """Python that binds ``data`` to ``size_mb`` MB of float32 in the given shape."""
    if shape == "tensor":
        return f"data = torch.ones({size_mb * MB // 4})"
    return f"data = {{f'layer{{i}}.weight': torch.ones({MB // 4}) for i in range({size_mb})}}"


def _status(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            name, _, value = line.partition(":")
            if name in RSS_FIELDS:
                fields[name] = int(value.split()[0]) * 1024
    return fields


class PeakMemory:
    """A process's peak growth in resident pages while the block runs, sampled every 5 ms: the
    growth of anonymous, file-backed and shared pages each (a kind that shrinks, say the heap
    giving back what the last cell freed, does not hide another that grows)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.growth = 0
        self._stop = threading.Event()

    def __enter__(self) -> "PeakMemory":
        self.start = _status(self.pid)
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            now = _status(self.pid)
            self.growth = max(self.growth, sum(max(0, now[field] - self.start[field]) for field in RSS_FIELDS))
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _first_line_at(ran, needle: str) -> float:
    return next(m.at for m in ran.messages if m.type == "stream" and needle in m.content["text"])


def closure_to_first_line(kernel: Kernel, shape: str, size_mb: int) -> tuple[float, float, float, float, float]:
    """(seconds, seconds capturing nothing, rank private bytes, rank shared bytes, seconds from that
    line to the reply: the cell binds only ``n``, and the captured tensors are found untouched)."""
    assert kernel.execute(f"import torch\n{_make(shape, size_mb)}").reply["status"] == "ok"
    probe = ("import torch\nfields = dict(l.split(':', 1) for l in open('/proc/self/status') if l.startswith('Rss'))\n"
             "print('first', fields['RssAnon'].split()[0], fields['RssShmem'].split()[0], flush=True)\n")
    wait_for_spares(kernel, 1)
    ran = kernel.execute(f"#pragma taas --gpus 1\n{probe}n = len(data)\n")
    assert ran.reply["status"] == "ok", ran.error_text()
    seconds = _first_line_at(ran, "first")
    anon, shmem = (int(v) * 1024 for v in ran.stream("stdout").split("first", 1)[1].split()[:2])
    wait_for_spares(kernel, 1)
    empty = kernel.execute(f"#pragma taas --gpus 1\n{probe}")  # the same rank with torch and no closure
    kernel.execute("del data")
    base_anon, base_shmem = (int(v) * 1024 for v in empty.stream("stdout").split("first", 1)[1].split()[:2])
    return (seconds, _first_line_at(empty, "first"), max(0, anon - base_anon), max(0, shmem - base_shmem),
            ran.reply_at - seconds)


def last_line_to_bound(kernel: Kernel, shape: str, size_mb: int) -> tuple[float, int]:
    """(seconds from rank 0's last line to the reply with ``data`` bound, kernel's peak growth)."""
    kernel.execute("import torch\ndata = None")
    wait_for_spares(kernel, 1)
    with PeakMemory(kernel.pid) as memory:
        ran = kernel.execute(f"#pragma taas --gpus 1\nimport torch\n{_make(shape, size_mb)}\nprint('last', flush=True)\n",
                             timeout=600)
    assert ran.reply["status"] == "ok", ran.error_text()
    check = kernel.execute("print('bound', type(data).__name__)")
    assert "bound" in check.stream("stdout"), check.error_text()
    kernel.execute("del data")
    return ran.reply_at - _first_line_at(ran, "last"), memory.growth


def floor(shape: str, size_mb: int) -> float:
    """torch.save then torch.load of the same tensors through /dev/shm, in this process."""
    import torch

    data: object = eval(_make(shape, size_mb).split("=", 1)[1], {"torch": torch})  # noqa: S307 - our own literal
    fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="taas-bench-")
    os.close(fd)
    try:
        started = time.perf_counter()
        torch.save(data, path)
        loaded = torch.load(path)
        seconds = time.perf_counter() - started
        del loaded
    finally:
        os.unlink(path)
    return seconds


def baseline_tree(revision: str) -> str:
    tree = os.path.join(tempfile.gettempdir(), f"taas-bench-baseline-{revision}")
    if not os.path.isdir(tree):
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", tree, revision], check=True,
                       capture_output=True)
    return tree


def _median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", default="50,200,1000", help="MB, comma separated")
    parser.add_argument("--baseline", default=BASELINE, help="a commit to measure beside (empty: none)")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]

    kernels = {"now": Kernel()}
    if args.baseline:
        tree = baseline_tree(args.baseline)
        # Its own cwd too: ``python -m taas_magic.rank`` puts the working directory first on sys.path.
        kernels["before"] = Kernel(cwd=tree, env={"PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")})
    try:
        for kernel in kernels.values():  # a first cell, so every measured cell is warm
            assert kernel.execute("#pragma taas --gpus 1\nimport torch\nx = 1").reply["status"] == "ok"
        rows = []
        for size_mb in sizes:
            for shape in SHAPES:
                figures: dict[str, list] = {}
                for _ in range(args.repeats):
                    figures.setdefault("floor", []).append(floor(shape, size_mb))
                    for label, kernel in kernels.items():
                        figures.setdefault(f"in {label}", []).append(closure_to_first_line(kernel, shape, size_mb))
                        figures.setdefault(f"out {label}", []).append(last_line_to_bound(kernel, shape, size_mb))
                rows.append((size_mb, shape, figures))
                _print_row(size_mb, shape, figures, args.repeats)
    finally:
        for kernel in kernels.values():
            kernel.shutdown()
    print(f"\nmedians of {args.repeats} run(s); 'x floor' divides by torch.save + torch.load of the same tensors through /dev/shm")


def _print_row(size_mb: int, shape: str, figures: dict[str, list], repeats: int) -> None:
    size = size_mb * MB
    fl = _median(figures["floor"])
    in_now = [row[0] for row in figures["in now"]]
    launch = _median([row[1] for row in figures["in now"]])
    out_now = [row[0] for row in figures["out now"]]
    print(f"\n{size_mb} MB, {shape}: floor (torch.save + torch.load via /dev/shm) {fl:.3f} s")
    print(f"  closure -> rank 0's first line: {_median(in_now):.3f} s = {_median(in_now) / fl:.2f}x floor "
          f"(the same cell capturing nothing: {launch:.3f} s)")
    print(f"    rank 0's private memory {_median([r[2] for r in figures['in now']]) / size:.2f}x the closure, "
          f"its mapped shared pages {_median([r[3] for r in figures['in now']]) / size:.2f}x")
    print(f"    the same cell, first line -> reply (the capture found untouched, nothing sent back): "
          f"{_median([r[4] for r in figures['in now']]):.3f} s")
    print(f"  rank 0's last line -> names bound: {_median(out_now):.3f} s = {_median(out_now) / fl:.2f}x floor; "
          f"kernel peak growth {_median([r[1] for r in figures['out now']]) / size:.2f}x the results")
    if "in before" in figures:
        in_before = _median([row[0] for row in figures["in before"]])
        out_before = _median([row[0] for row in figures["out before"]])
        print(f"  before ({BASELINE}): closure -> first line {in_before:.3f} s ({in_before / fl:.2f}x floor), "
              f"last line -> bound {out_before:.3f} s ({out_before / fl:.2f}x floor), "
              f"kernel peak growth {_median([r[1] for r in figures['out before']]) / size:.2f}x")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
