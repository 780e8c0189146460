"""One 16-trial search of short DDP runs, through taas and through Ray Tune with TorchTrainer, side by side.

    python bench/trials.py [--rounds 2] [--trials 16] [--steps 2500] [--slots 2]

Needs ``pip install "ray[tune,train]" optuna`` (Ray Tune is only this bench's anchor).

Each trial trains a small MLP with DDP over 2 CPU ranks (gloo) for ``--steps`` steps at a
learning rate and width drawn at random (loguniform 1e-3..1e-1, one of 16/32/64), reporting
its loss every 10 steps. The host's ``--slots`` CPU cores stand for its GPUs: a trial holds
2 of them, so both tools run ``slots / 2`` trials at a time:

- taas: one cell, ``#pragma taas --device cpu --gpus 2 --trials 16 --sampler random --prune none``
  (``--parallel`` when more than one fits), in a real kernel driven by jupyter_client, after
  the same cell ran once alone (``taas.trial()``'s defaults, 50 steps), as a person tries a cell
  before searching with it, and once its spares wait and their factory has imported (``%taas
  status`` says so; a kernel a person has used for more than a few seconds is there already);
- Ray Tune: ``tune.Tuner`` over a driver function that fits a ``TorchTrainer`` of 2 workers
  (``ScalingConfig(num_workers=2)``), random search over the same space, and
  ``max_concurrent_trials = slots / 2``, as Ray's docs ask for Train V2 under Tune (the cluster,
  ``ray.init(num_cpus=slots + 1)``, has a CPU for the trial's driver besides its workers);
  the cluster is started before the clock starts.

Figures, per round and as the median over rounds (each round runs both, taas first):

- trials per hour: 16 / the search's wall time (the cell's, the ``Tuner.fit()``'s);
- busy: the share of the slots' time the ranks spent in the training loop, from the start of
  the search to its end (each rank writes when its loop began and ended, the same code in
  both tools): what keeping the GPUs busy means here.

Targets: taas at least 1.3x Ray Tune's trials per hour, and at least 95% busy.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kernel_client import Kernel  # the repository's own client, after the path

TRAIN = '''
def train_loop(lr, width, steps, log_dir, tag, report):
    import os, time, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    began = time.time()
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 10 == 9:
            report(step, float(loss))
    ended = time.time()
    with open(os.path.join(log_dir, f"{tag}-{os.getpid()}-{rank}.busy"), "w") as out:
        out.write(f"{began} {ended}")
    return float(loss)
'''

TAAS_CELL = '''#pragma taas --device cpu --gpus 2 {search}
import taas, torch.distributed as dist
dist.init_process_group("gloo")
t = taas.trial()
lr = t.suggest_float("lr", 1e-3, 1e-1, log=True, default=1e-2)
width = t.suggest_categorical("width", [16, 32, 64], default=32)
final = train_loop(lr, width, {steps}, {log_dir!r}, "taas", lambda step, loss: taas.report(step, loss=loss))
taas.report({steps}, loss=final)
dist.destroy_process_group()
'''


def wait_until_warm(kernel: Kernel, spares: int, timeout: float = 120) -> None:
    """Until the kernel's spares wait (named taas-spare) and their factory forks new ones."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = kernel.execute("%taas status").stream()
        waiting = sum(process.name() == "taas-spare" for process in kernel.spares())
        if waiting >= spares and "factory (ready" in status:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the kernel's spares were not warm within {timeout:.0f} s")


def busy_share(log_dir: str, tag: str, began: float, ended: float, slots: int) -> float:
    spans = []
    for path in glob.glob(os.path.join(log_dir, f"{tag}-*.busy")):
        start, end = map(float, Path(path).read_text().split())
        spans.append(min(end, ended) - max(start, began))
    return sum(spans) / ((ended - began) * slots)


def run_taas(kernel: Kernel, trials: int, steps: int, slots: int, log_dir: str) -> tuple[float, float]:
    at_once = slots // 2
    search = f"--trials {trials} --sampler random --prune none" + (f" --parallel {at_once}" if at_once > 1 else "")
    cell = TAAS_CELL.format(search=search, steps=steps, log_dir=log_dir)
    began = time.time()
    ran = kernel.execute(cell, timeout=3600)
    ended = time.time()
    if ran.reply["status"] != "ok":
        raise RuntimeError(ran.error_text())
    return ended - began, busy_share(log_dir, "taas", began, ended, slots)


def run_ray_tune(trials: int, steps: int, slots: int, log_dir: str, storage: str) -> tuple[float, float]:
    import ray
    from ray import train, tune
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    namespace: dict = {}
    exec(TRAIN, namespace)  # noqa: S102 - the same loop as the taas cell's, our own text
    train_loop = namespace["train_loop"]

    def per_worker(config: dict) -> None:
        final = train_loop(config["lr"], config["width"], steps, log_dir, "ray", lambda step, loss: None)
        train.report({"loss": final})

    def driver(config: dict) -> None:
        trainer = TorchTrainer(per_worker, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                               run_config=train.RunConfig(storage_path=storage, name=f"t{time.time_ns()}"))
        result = trainer.fit()
        tune.report({"loss": (result.metrics or {}).get("loss", 0.0)})

    space = {"lr": tune.loguniform(1e-3, 1e-1), "width": tune.choice([16, 32, 64])}
    tuner = tune.Tuner(driver, param_space=space,
                       tune_config=tune.TuneConfig(num_samples=trials, max_concurrent_trials=max(1, slots // 2)),
                       run_config=tune.RunConfig(storage_path=storage, name="bench", verbose=0))
    began = time.time()
    results = tuner.fit()
    ended = time.time()
    errors = [str(result.error) for result in results if result.error is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} Ray Tune trial(s) failed: {errors[0][:500]}")
    del ray
    return ended - began, busy_share(log_dir, "ray", began, ended, slots)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--slots", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    import ray

    ray.init(num_cpus=args.slots + 1, include_dashboard=False, log_to_driver=False)
    kernel = Kernel()
    rows = []
    try:
        kernel.execute(TRAIN)
        with tempfile.TemporaryDirectory() as log_dir:  # the cell run alone first (its defaults), as a person does
            alone = kernel.execute(TAAS_CELL.format(search="", steps=50, log_dir=log_dir), timeout=300)
        assert alone.reply["status"] == "ok", alone.error_text()
        for round_no in range(args.rounds):
            wait_until_warm(kernel, 2)
            with tempfile.TemporaryDirectory() as log_dir, tempfile.TemporaryDirectory() as storage:
                taas_wall, taas_busy = run_taas(kernel, args.trials, args.steps, args.slots, log_dir)
                ray_wall, ray_busy = run_ray_tune(args.trials, args.steps, args.slots, log_dir, storage)
            print(f"round {round_no + 1}: taas {taas_wall:.1f} s, Ray Tune {ray_wall:.1f} s", flush=True)
            rows.append((taas_wall, taas_busy, ray_wall, ray_busy))
            print(f"round {round_no + 1}: taas {args.trials / taas_wall * 3600:.0f} trials/h, {taas_busy:.1%} busy; "
                  f"Ray Tune {args.trials / ray_wall * 3600:.0f} trials/h, {ray_busy:.1%} busy; "
                  f"ratio {ray_wall / taas_wall:.2f}x", flush=True)
    finally:
        kernel.shutdown()
        ray.shutdown()
    ratios = [ray_wall / taas_wall for taas_wall, _, ray_wall, _ in rows]
    taas_rate = statistics.median(args.trials / row[0] * 3600 for row in rows)
    ray_rate = statistics.median(args.trials / row[2] * 3600 for row in rows)
    print(f"\n{args.trials} trials of 2 CPU ranks x {args.steps} steps, {args.slots} slots, {len(rows)} round(s); medians:\n")
    print("| figure | taas | Ray Tune (TorchTrainer) | floor |")
    print("|---|---|---|---|")
    print(f"| trials per hour | {taas_rate:.0f} | {ray_rate:.0f} | taas >= 1.3x Ray Tune |")
    print(f"| paired ratio (Ray's wall / taas's) | {statistics.median(ratios):.2f}x | 1.00x | >= 1.30x |")
    print(f"| slots busy | {statistics.median(row[1] for row in rows):.1%} | {statistics.median(row[3] for row in rows):.1%} "
          f"| taas >= 95% |")


if __name__ == "__main__":
    main()
