"""What the overlay view of the repository costs a rank other than 0: its file-system loop, and a refresh.

    python bench/repoview.py [--runs 31] [--files 2000] [--folders 20] [--refreshes 200] [--barriers 200]

A repository of ``--files`` small files (1 to 8 KB) in ``--folders`` folders, made in the system temp dir. Two
child processes of this script, started once and driven one command at a time (``unshare`` needs a
single-threaded process, so neither is this one): a plain one (no namespace: what a process without taas, a
torchrun rank, pays) and one inside the overlay view a rank other than 0 has (writes/namespace.py's
``divert_writes``, its scratch layer beside the repository). Each stands in the repository and uses relative
paths, as a cell does. Rows:

- the file loop: ``os.listdir`` of every folder, ``os.stat`` of every file, ``open`` + ``read`` of every file,
  ``os.path.exists`` of one missing path per folder; one pass timed, phase by phase. ``--runs`` pairs (default
  31), ABBA (the plain child first in even pairs, the overlay child first in odd ones), each child warmed by two
  passes first. Printed: each side's median (min-max) in ms, the median of the paired ratios (overlay / plain)
  with its 95% interval (bench/intervals.py), and the floor: **at most 1.10x**.
- the same loop as the first pass over a fresh view: the overlay child refreshes (``refresh.refresh()``) right
  before it, so the overlay's dentry and inode caches are empty (a refresh follows every collective); paired
  with the same plain pass. No floor: it is paid once per collective, not per pass.
- one refresh, ``refresh.refresh()`` timed in the overlay child: ``--refreshes`` back to back (default 200;
  the view replaced has nothing cached); the refresh of the row above (right after a pass: the view replaced
  holds the pass's dentries); and ``--runs`` more such, the child standing outside the repository (``cwd /``)
  as it refreshes, so the working directory does not hold the old view. Median (min-max) and p90; a plain
  process pays none (0).
- a collective: ``dist.barrier()`` on a one-process gloo group (``init_method`` file://) in the overlay child, with
  writes/refresh.py's ``follow_collectives`` installed beside the same barrier unwrapped (what rank 0 and a
  plain process pay), ``--barriers`` ABBA pairs (default 200): each side's median per call, the median of the
  paired ratios with its 95% interval, and the median of the paired differences (what the refresh adds).

Then the file loop phase by phase: each phase's median on each side and its median paired ratio (where the
overlay's cost lies). The machine (cores, kernel, torch) is printed first. The whole run takes about 10 s on 2
cores; no run is dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.intervals import median_interval  # noqa: E402
from taas_magic.tempdirs import remove_tree  # noqa: E402

FLOOR = 1.10  # the overlay's file loop over a plain process's, at most


def make_repository(root: str, files: int, folders: int) -> int:
    """``files`` files of 1 to 8 KB spread over ``folders`` folders under ``root``; their bytes in all."""
    size = 0
    for k in range(files):
        folder = os.path.join(root, f"pkg{k % folders:02d}")
        os.makedirs(folder, exist_ok=True)
        text = (f"# module {k}\n" + "x = 1\n" * (170 * (1 + k % 8))).encode()
        with open(os.path.join(folder, f"module{k:05d}.py"), "wb") as handle:
            handle.write(text)
        size += len(text)
    return size


# --- the children -------------------------------------------------------------------------------------------

PHASES = ("listdir", "stat", "open+read", "exists")  # the file loop's, in its order


def file_loop(folders: list[str], files: list[str], missing: list[str]) -> dict[str, float]:
    """One pass of a rank's file-system loop over relative paths: seconds, phase by phase (:data:`PHASES`)."""
    clock = time.perf_counter
    started = clock()
    for folder in folders:
        os.listdir(folder)
    listed = clock()
    for path in files:
        os.stat(path)
    statted = clock()
    for path in files:
        with open(path, "rb") as handle:
            handle.read()
    read = clock()
    for path in missing:
        os.path.exists(path)
    return dict(zip(PHASES, (listed - started, statted - listed, read - statted, clock() - read)))


def barriers(scratch: str, pairs: int) -> dict[str, list[float]]:
    """``dist.barrier()`` unwrapped and with ``follow_collectives``, ABBA, each call timed; seconds."""
    import torch.distributed as dist

    from taas_magic.writes import refresh

    store = os.path.join(scratch, "store")
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    unwrapped = dist.barrier
    refresh.follow_collectives(dist)
    ways = {"without": unwrapped, "with": dist.barrier}
    assert ways["with"] is not unwrapped, "follow_collectives did not wrap dist.barrier (no overlay?)"
    times: dict[str, list[float]] = {"without": [], "with": []}
    for pair in range(-10, pairs):  # ten warm-up pairs, not kept
        for name in ("without", "with") if pair % 2 == 0 else ("with", "without"):
            started = time.perf_counter()
            ways[name]()
            if pair >= 0:
                times[name].append(time.perf_counter() - started)
    dist.destroy_process_group()
    return times


def child(way: str, repository: str, scratch: str) -> None:
    """A plain process, or one in the overlay view (``way``): one JSON line per command read from stdin."""
    from taas_magic.writes import namespace, refresh

    if way == "overlay":
        namespace.divert_writes(repository, scratch)  # first: the process has one thread
        refresh._views = refresh.Views(repository, scratch)  # the one a rank makes at its first refresh
    os.chdir(repository)
    folders = sorted(name for name in os.listdir(".") if name.startswith("pkg"))
    files = [os.path.join(folder, name) for folder in folders for name in sorted(os.listdir(folder))]
    missing = [os.path.join(folder, "missing.py") for folder in folders]
    for line in sys.stdin:
        command, count = line.split()
        if command == "loop":
            said: object = file_loop(folders, files, missing)
        elif command == "fresh":  # a refresh right after a pass, then the first pass over the view it made
            started = time.perf_counter()
            refresh.refresh()
            refreshed = time.perf_counter() - started
            said = {**file_loop(folders, files, missing), "refresh": refreshed}
        elif command == "remounts":
            seconds = []
            for _ in range(int(count)):
                started = time.perf_counter()
                refresh.refresh()
                seconds.append(time.perf_counter() - started)
            said = {"seconds": seconds, "beneath": refresh._views is not None and refresh._views.beneath}
        elif command == "outside":  # the same refresh after a pass, the process standing outside the repository
            seconds = []
            for _ in range(int(count)):
                file_loop(folders, files, missing)
                os.chdir("/")
                started = time.perf_counter()
                refresh.refresh()
                seconds.append(time.perf_counter() - started)
                os.chdir(repository)
            said = seconds
        else:
            said = barriers(scratch, int(count))
        print(json.dumps(said), flush=True)


class Child:
    """One child process of this script, asked one command at a time."""

    def __init__(self, way: str, repository: str, scratch: str) -> None:
        self.process = subprocess.Popen([sys.executable, __file__, "--child", way, repository, scratch], text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)

    def ask(self, command: str, count: int = 0) -> Any:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{command} {count}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the child ended on {command!r} (exit {self.process.wait()}); see its stderr above")
        return json.loads(line)


# --- the parent ---------------------------------------------------------------------------------------------


def loops(plain: Child, overlay: Child, runs: int) -> dict[str, list[dict[str, float]]]:
    """``runs`` ABBA pairs of the file loop: the plain pass, the overlay's warm pass, and its refresh with the
    first pass over the view it made; seconds, phase by phase (and ``refresh``)."""
    for _ in range(2):
        plain.ask("loop")
        overlay.ask("loop")
    times: dict[str, list[dict[str, float]]] = {"plain": [], "warm": [], "fresh": []}
    for pair in range(runs):
        asks = [("plain", plain, "loop"), ("fresh", overlay, "fresh"), ("warm", overlay, "loop")]
        for name, who, command in asks if pair % 2 == 0 else asks[::-1]:
            times[name].append(who.ask(command))
    return times


def ratios(over: list[float], under: list[float]) -> tuple[list[float], str]:
    """The paired ratios, and their median's 95% interval as printed."""
    paired = [a / b for a, b in zip(over, under)]
    low, high = median_interval(paired)
    return paired, f"{low:.3f}-{high:.3f}x"


def ms(samples: list[float]) -> list[float]:
    return [1e3 * value for value in samples]


def cell(samples: list[float], unit: str) -> str:
    """``median (min-max)`` as the house prints it (bench/cells.py's rows; imported here, not in the children:
    bench/cells.py imports jupyter_client)."""
    from bench.cells import row

    return row("", samples, None, "", unit).split(" | ")[1]


def report(times: dict[str, list[dict[str, float]]], remounts: dict[str, Any], collective: dict[str, list[float]]) -> None:
    """The tables (see the module docstring)."""
    total = {name: [sum(one[phase] for phase in PHASES) for one in runs] for name, runs in times.items()}
    print("| row | taas rank other than 0 (overlay view) | plain process (no taas) | paired ratio, overlay / plain "
          "| its 95% interval | target |\n" + "| --- " * 6 + "|")
    for name, title in (("warm", "the file loop, warm view"), ("fresh", "the file loop, first pass after a refresh")):
        paired, interval = ratios(total[name], total["plain"])
        median = statistics.median(paired)
        target = f"<= {FLOOR:.2f}x: {'met' if median <= FLOOR else 'not met'}" if name == "warm" else "none (once a collective)"
        print(f"| {title} | {cell(ms(total[name]), 'ms')} | {cell(ms(total['plain']), 'ms')} | {cell(paired, 'x')} "
              f"| {interval} | {target} |")
    for title, seconds in (("one refresh (refresh.refresh), back to back: the old view holds nothing", remounts["seconds"]),
                           ("one refresh right after a pass of the file loop", [one["refresh"] for one in times["fresh"]]),
                           ("the same, the process standing outside the repository (cwd /)", remounts["outside"])):
        p90 = statistics.quantiles(ms(seconds), n=10, method="inclusive")[-1]
        print(f"| {title} | {cell(ms(seconds), 'ms')}, p90 {p90:.3f} ms | none: 0 ms | | | |")
    paired, interval = ratios(collective["with"], collective["without"])
    added = statistics.median([1e3 * (a - b) for a, b in zip(collective["with"], collective["without"])])
    print(f"| dist.barrier(), one-process gloo group: with follow_collectives / without (rank 0's, a plain process's) "
          f"| {cell(ms(collective['with']), 'ms')} | {cell(ms(collective['without']), 'ms')} | {cell(paired, 'x')} "
          f"| {interval} | the refresh adds {added:.3f} ms a call (median of the paired differences) |")
    print("\nthe file loop phase by phase: each side's median, the median of the paired ratios over the plain process\n\n"
          "| phase | plain | warm view | warm / plain | first pass after a refresh | fresh / plain |\n" + "| --- " * 6 + "|")
    for phase in PHASES:
        plain = [one[phase] for one in times["plain"]]
        shown = [f"{statistics.median(ms(plain)):.3f} ms"]
        for name in ("warm", "fresh"):
            mine = [one[phase] for one in times[name]]
            shown += [f"{statistics.median(ms(mine)):.3f} ms", f"{statistics.median(ratios(mine, plain)[0]):.2f}x"]
        print(f"| {phase} | " + " | ".join(shown) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=31, help="ABBA pairs of the file loop")
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--folders", type=int, default=20)
    parser.add_argument("--refreshes", type=int, default=200)
    parser.add_argument("--barriers", type=int, default=200, help="ABBA pairs of dist.barrier()")
    parser.add_argument("--child", nargs=3, metavar=("WAY", "REPOSITORY", "SCRATCH"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        child(*arguments.child)
        return
    print(f"bench/repoview.py: {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}, "
          f"torch {metadata.version('torch')}")
    top = tempfile.mkdtemp(prefix="taas-bench-repoview-")
    repository, scratch = os.path.join(top, "repo"), os.path.join(top, "scratch")
    started = time.monotonic()
    children: list[Child] = []
    try:
        size = make_repository(repository, arguments.files, arguments.folders)
        os.makedirs(scratch)
        plain, overlay = Child("plain", repository, scratch), Child("overlay", repository, scratch)
        children = [plain, overlay]
        times = loops(plain, overlay, arguments.runs)
        remounts = overlay.ask("remounts", arguments.refreshes)
        remounts["outside"] = overlay.ask("outside", arguments.runs)
        collective = overlay.ask("barriers", arguments.barriers)
    finally:
        for each in children:
            each.process.kill()
            each.process.wait()
        remove_tree(top)
    print(f"a repository of {arguments.files} files ({size / 1e6:.1f} MB) in {arguments.folders} folders; the file loop: "
          f"os.listdir of each folder, os.stat of each file, open+read of each, os.path.exists of {arguments.folders} "
          f"missing paths; {arguments.runs} ABBA pairs; {arguments.refreshes} refreshes back to back "
          f"({'mounted beneath' if remounts['beneath'] else 'mounted on top: no MOVE_MOUNT_BENEATH'}); "
          f"{arguments.barriers} ABBA pairs of barriers; {time.monotonic() - started:.0f} s in all\n")
    report(times, remounts, collective)


if __name__ == "__main__":
    main()
