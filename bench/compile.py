"""What a compiled cell costs when it runs again in fresh ranks: taas's session compile cache beside
torch's own per-user cache, which is what a person gets with torchrun.

    python bench/compile.py [--repeats 3] [--precompile]

Measured in one run, side by side, each arm cold at its first run and warmed only by its own runs:

- taas, cache on (the default): a fresh kernel, so a new and empty session folder
  (compilecache/folder.py); the same compiled cell run 3 times, each in fresh ranks (the warm
  spares the cell before left: new processes, torch imported);
- taas, cache off (``%config TaasMagics.compile_cache = False``): a fresh kernel whose
  ``TORCHINDUCTOR_CACHE_DIR`` is a new empty folder, standing in for torch's per-user folder on a
  machine that never compiled this model; the same 3 runs;
- torchrun: ``torchrun --standalone --nproc-per-node 2`` of the same code as a script, 3 times,
  ``TORCHINDUCTOR_CACHE_DIR`` a new empty folder;
- with ``--precompile``, a fourth arm: taas with the cache on and ``TORCH_CACHING_PRECOMPILE=1`` in
  the kernel's environment (torch's experimental Dynamo cache: it drops guards, see
  docs/benchmarks.md), to show what Dynamo-level caching would add.

torch keeps its precompiled C++ header in its per-user folder whatever ``TORCHINDUCTOR_CACHE_DIR``
says; the bench builds it first (the anatomy's cold run, below), so every arm's cold run finds it,
as a new session on a machine that compiled anything before does.

The cell: 2 CPU ranks (gloo), a small MLP compiled with ``torch.compile`` and wrapped in DDP
(``DDP(torch.compile(model))``: on torch 2.13 ``torch.compile(DDP(model))`` breaks the graph at DDP's
forward and compiles nothing, so the cell asserts that Dynamo captured a graph). Rank 0 prints the
seconds from compiling the model through the first step's backward: Dynamo, AOTAutograd, Inductor
and the C++ build, or the caches' answer.

Between two runs of a taas arm with the cache on, the bench waits, as a person reads the output, until
``%taas status`` says the spares' factory has torch's compiler warmed (launch/local/factories.py: it
starts warming once a cell's ranks compiled; at most ``PAUSE_MOST`` seconds), and reports that wait.

Each figure is that compile time; the ratios are paired: a run's time over the same arm's cold run in
the same repeat. Target: the 2nd run at most 0.20x its cold run with the cache on. Medians of
--repeats (min, max); the arms' order alternates between repeats (ABC, CBA), so none always runs on
the machine the others left.

The anatomy of a compile: the same MLP compiled in one process (no DDP), once on a "machine that
never compiled" (a temp dir of its own), then --repeats times whose caches hold it, after one cold
run, in three parts: importing Dynamo, AOTAutograd and Inductor; Inductor's probe of the CPU's
vector instructions (it builds a test program per instruction set, cached, then loads each in a
child Python, in every process); the rest (Dynamo's trace, the cache keys, the caches' answers,
loading the built kernels).
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

from tests.kernel_client import Kernel  # noqa: E402

RUNS = 3  # the same cell, run this many times in fresh ranks per arm and repeat
PAUSE_MOST = 120.0  # seconds a cache-on arm waits after a run for the spares' factory to have the compiler warmed
pauses: list[float] = []  # each such wait, for the report
CODE = """\
import time, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 10))
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
started = time.perf_counter()
compiled = torch.nn.parallel.DistributedDataParallel(torch.compile(model))
torch.nn.functional.cross_entropy(compiled(x), y).backward()
seconds = time.perf_counter() - started
from torch._dynamo.utils import counters
assert counters["stats"]["unique_graphs"] >= 1, "Dynamo captured no graph: nothing was compiled"
if dist.get_rank() == 0:
    print(f"compile-seconds {seconds:.3f}", flush=True)
dist.destroy_process_group()
"""
CELL = "#pragma taas --device cpu --gpus 2\n" + CODE
ANATOMY = """\
import time, torch
started = time.perf_counter()
import torch._dynamo, torch._functorch.aot_autograd, torch._inductor.codecache, torch._inductor.compile_fx
imported = time.perf_counter()
from torch._inductor import cpu_vec_isa  # private: the probe torch runs on its first CPU compile, timed apart
cpu_vec_isa.valid_vec_isa_list()
probed = time.perf_counter()
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 10))
torch.compile(model)(torch.randn(32, 64)).sum().backward()
print("anatomy", imported - started, probed - imported, time.perf_counter() - probed)
"""
ARMS = ("taas, cache on", "taas, cache off", "torchrun")
PRECOMPILE = "taas, cache on + precompile"


def _seconds(output: str) -> float:
    lines = [line for line in output.splitlines() if "compile-seconds " in line]
    assert lines, output
    return float(lines[0].split("compile-seconds ")[1].split()[0])


def taas_runs(cache: bool, env: dict[str, str]) -> list[float]:
    """The cell's compile time in each of RUNS runs in one fresh kernel (``env`` added to its environment)."""
    kernel = Kernel(cwd=str(ROOT), env=env)
    try:
        if not cache:
            kernel.execute("%config TaasMagics.compile_cache = False")
        times = []
        for run in range(RUNS):
            ran = kernel.execute(CELL, timeout=900)
            assert ran.reply["status"] == "ok", ran.error_text()
            times.append(_seconds(ran.stream("stdout")))
            if cache and run + 1 < RUNS:
                _pause(kernel)
        kernel.execute("%unload_ext taas_magic")  # its session folder goes with it (a killed kernel's waits for a sweep)
        return times
    finally:
        kernel.shutdown()


def _pause(kernel: Kernel) -> None:
    """A person's pause after a compiled cell: until the spares' factory has torch's compiler warmed."""
    started = time.monotonic()
    while "compiler warmed" not in kernel.execute("%taas status").stream():
        if time.monotonic() - started > PAUSE_MOST:
            raise AssertionError(f"the spares' factory did not warm torch's compiler within {PAUSE_MOST:g} s")
        time.sleep(0.5)
    pauses.append(time.monotonic() - started)


def torchrun_runs(folder: Path) -> list[float]:
    """The script's compile time in each of RUNS ``torchrun --nproc-per-node 2`` runs, sharing ``folder``'s cache."""
    script = folder / "compiled.py"
    script.write_text(CODE)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
    times = []
    for _ in range(RUNS):
        ran = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(script)], capture_output=True, text=True, timeout=900, cwd=folder, env=env)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        times.append(_seconds(ran.stdout))
    return times


def one_arm(arm: str) -> list[float]:
    """One arm's RUNS compile times, starting from a cache folder of its own that nothing has warmed."""
    folder = Path(tempfile.mkdtemp(prefix="taas-bench-compile-"))
    try:
        if arm == "taas, cache on":
            return taas_runs(True, {})  # a fresh kernel: a new, empty session folder
        if arm == PRECOMPILE:
            return taas_runs(True, {"TORCH_CACHING_PRECOMPILE": "1"})
        if arm == "taas, cache off":
            return taas_runs(False, {"TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")})
        return torchrun_runs(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _anatomy_run(env: dict[str, str]) -> list[float]:
    ran = subprocess.run([sys.executable, "-c", ANATOMY], capture_output=True, text=True, timeout=900, env=env)
    assert ran.returncode == 0, ran.stderr
    return [float(word) for word in ran.stdout.split("anatomy ")[1].split()[:3]]


def anatomy(repeats: int) -> tuple[float, dict[str, list[float]]]:
    """A compile on a machine that never compiled (a temp dir of its own: torch builds its precompiled
    header there), then the parts of a warm compile in one process, after a cold run in the machine's
    temp dir, which builds that header for every arm if it is not there yet."""
    folder = Path(tempfile.mkdtemp(prefix="taas-bench-compile-"))
    (folder / "tmp").mkdir()
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"), "OMP_NUM_THREADS": "1"}
    parts: dict[str, list[float]] = {"imports": [], "probe": [], "rest": []}
    try:
        first_ever = sum(_anatomy_run({**env, "TMPDIR": str(folder / "tmp"),
                                       "TORCHINDUCTOR_CACHE_DIR": str(folder / "tmp" / "inductor")}))
        _anatomy_run(env)  # cold in its folder; torch's header in the machine's temp dir, for the arms
        for _ in range(repeats):
            for name, value in zip(parts, _anatomy_run(env)):
                parts[name].append(value)
        return first_ever, parts
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def row(name: str, values: list[float], unit: str, target: str, beside: str) -> str:
    median = statistics.median(values)
    return f"{name:<50} {median:8.3f}{unit} {min(values):8.3f} {max(values):8.3f}  {target:<22} {beside}"


def report(times: dict[str, list[list[float]]], anatomy_seconds: tuple[float, dict[str, list[float]]], repeats: int,
           loads: tuple[str, str]) -> None:
    m = statistics.median
    print(f"bench/compile.py: {repeats} repeats of {RUNS} runs per arm, medians (min, max); "
          f"2 CPU ranks, gloo, {os.cpu_count()} cores; load average {loads[0]} at the start, {loads[1]} at the end")
    print(f"{'figure':<50} {'median':>9} {'min':>8} {'max':>8}  {'target':<22} beside")
    cold = {arm: [runs[0] for runs in arm_runs] for arm, arm_runs in times.items()}
    for arm, arm_runs in times.items():
        print(row(f"{arm}: cold (1st run)", cold[arm], " s", "", ""))
        for run in range(1, RUNS):
            seconds = [runs[run] for runs in arm_runs]
            ratios = [runs[run] / runs[0] for runs in arm_runs]
            print(row(f"{arm}: run {run + 1}", seconds, " s", "", ""))
            target = "<= 0.20x: " + ("met" if m(ratios) <= 0.20 else "not met") if arm.startswith("taas, cache on") \
                and run == 1 else ""
            others = [f"{other} {m([runs[run] / runs[0] for runs in times[other]]):.2f}x"
                      for other in times if other != arm and not other.startswith("taas, cache on")]
            print(row(f"{arm}: run {run + 1} / cold (paired)", ratios, "x ", target,
                      ", ".join(others) if arm.startswith("taas, cache on") else ""))
    if pauses:
        print(row("cache on: after a run, until the compiler is warmed", pauses, " s", "",
                  "the bench's pause (a person's, reading)"))
    first_ever, parts = anatomy_seconds
    print(row("one process, the machine's first compile", [first_ever], " s", "",
              "torch builds its precompiled header (once a machine)"))
    total = [sum(values) for values in zip(*parts.values())]
    names = {"imports": "importing Dynamo, AOTAutograd, Inductor", "probe": "Inductor's CPU ISA probe",
             "rest": "trace, cache keys, the caches' answers"}
    print(row("one process, warm: the whole compile", total, " s", "", "no cache removes the two below"))
    for name, values in parts.items():
        print(row(f"  {names[name]}", values, " s", "", f"{m(values) / m(total):.0%} of it"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precompile", action="store_true", help="also measure TORCH_CACHING_PRECOMPILE=1")
    args = parser.parse_args()
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # each arm names its own folder
    arms = ARMS + ((PRECOMPILE,) if args.precompile else ())
    times: dict[str, list[list[float]]] = {arm: [] for arm in arms}
    start_load = " ".join(f"{load:.1f}" for load in os.getloadavg())
    parts = anatomy(args.repeats)  # first: it builds torch's precompiled header for every arm
    for repeat in range(args.repeats):
        for arm in arms if repeat % 2 == 0 else tuple(reversed(arms)):
            times[arm].append(one_arm(arm))
            print(f"[bench] repeat {repeat + 1}, {arm}: {', '.join(f'{t:.2f}' for t in times[arm][-1])} s", flush=True)
    report(times, parts, args.repeats, (start_load, " ".join(f"{load:.1f}" for load in os.getloadavg())))


if __name__ == "__main__":
    main()
