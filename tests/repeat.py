"""Run named tests N times in a row, each time in a fresh pytest process, and print the pass count.

    python tests/repeat.py tests/browser/test_jupyterlab.py -n 30
    python tests/repeat.py "tests/kernel/test_detach.py::test_wait_wakes_at_once" -n 30 --stop-on-failure
    python tests/repeat.py $(cat tests/time-asserting.txt) -n 30 --burn 2

What a flaky test is: one that fails once in N cold runs. Each run is a new interpreter (a new
kernel, new spares, new ports), as CI's is; the pytest cache is off. The table at the end gives
each run's outcome and wall time, the pass count (``passed N of M``), and, for every failing run,
the file its full output was kept in. Exit status 0 only when every run passed.

``--burn K`` keeps K busy-looping processes (normal priority) running for the whole repeat, so the
tests run on a machine as loaded as a person's, whose first ``pytest`` runs beside whatever else it
does; they are ended whatever happens. ``tests/time-asserting.txt`` lists the tests that assert what
happens within a time.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(tests: list[str], extra: list[str], timeout: float) -> tuple[bool, float, str]:
    started = time.monotonic()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *tests]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        output, passed = done.stdout + done.stderr, done.returncode == 0
    except subprocess.TimeoutExpired as exc:
        output = f"{exc.stdout or ''}{exc.stderr or ''}\n[repeat] timed out after {timeout:g} s"
        passed = False
    return passed, time.monotonic() - started, output


def _spin() -> None:
    while True:
        pass


def _burners(count: int) -> list[multiprocessing.Process]:
    burners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]
    for burner in burners:
        burner.start()
    return burners


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="+", help="pytest node ids or paths")
    parser.add_argument("-n", "--runs", type=int, default=30)
    parser.add_argument("--stop-on-failure", action="store_true")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    parser.add_argument("--burn", type=int, default=0, help="busy-looping processes beside the runs (a loaded machine)")
    args = parser.parse_args()
    burners = _burners(args.burn)
    try:
        return _repeat(args)
    finally:
        for burner in burners:
            burner.kill()
            burner.join()


def _repeat(args: argparse.Namespace) -> int:
    keep = Path(tempfile.mkdtemp(prefix="taas-repeat-"))
    outcomes: list[tuple[bool, float]] = []
    for number in range(1, args.runs + 1):
        passed, seconds, output = run_once(args.tests, args.pytest_args.split(), args.timeout)
        outcomes.append((passed, seconds))
        note = ""
        if not passed:
            path = keep / f"run{number}.log"
            path.write_text(output)
            note = f"  output: {path}"
        print(f"run {number:3d}: {'pass' if passed else 'FAIL'} {seconds:6.1f} s{note}", flush=True)
        if not passed and args.stop_on_failure:
            break
    passes = sum(passed for passed, _ in outcomes)
    times = [seconds for _, seconds in outcomes]
    print(f"{' '.join(args.tests)}: passed {passes} of {len(outcomes)} "
          f"(median {statistics.median(times):.1f} s, min {min(times):.1f}, max {max(times):.1f}; "
          f"{os.cpu_count()} cores, {args.burn} burner(s))")
    return 0 if passes == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
