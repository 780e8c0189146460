"""The cluster mode's cost: ``--gpus 4`` on a local multi-node Ray cluster, beside Ray Train.

    python bench/launch.py --cluster [--repeats 5]

One real Ray cluster on this machine (two nodes declaring 2 GPUs each, one CPU-only
node, as tests/ray uses) serves both, alternating, in one run:

- taas: a kernel attached with ``%taas cluster ADDRESS`` runs a ``--gpus 4`` cell (the
  50-step DDP loop of bench/launch.py); timed from execute_request to rank 0's first
  line on iopub, and to the cell's end;
- Ray Train: a kernel that is a plain Ray driver runs ``TorchTrainer(train, ScalingConfig
  (num_workers=4, use_gpu=True, resources_per_worker={"GPU": 1}), torch_config=TorchConfig
  (backend="gloo"))`` on the same loop (Ray Train sets up
  the process group itself); rank 0's first line reaches the cell through Ray's log
  forwarding, as it does for its users.

Needs ``pip install "ray[train]"`` for the Ray Train column (skipped without it).
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import textwrap

from bench.anchors import MODEL, STEP, STEPS, _time_cell
from tests.kernel_client import Kernel

TRAIN_BODY = (
    "import torch, torch.distributed as dist\n"
    "if dist.get_rank() == 0:\n"
    '    print("first-line", flush=True)\n'
    + MODEL + f"for i in range({STEPS}):\n" + STEP
)

TAAS_CELL = (
    "#pragma taas --gpus 4\nimport torch.distributed as dist\n"
    "dist.init_process_group('gloo', init_method='env://')\n" + TRAIN_BODY + "dist.destroy_process_group()\n"
)

RAY_TRAIN_SETUP = """\
import ray, tempfile
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
ray.init(address={address!r})
_storage = tempfile.mkdtemp()
"""
RAY_TRAIN_CELL = (
    "def train():\n" + textwrap.indent(TRAIN_BODY, "    ") + "\n"
    "TorchTrainer(train, scaling_config=ScalingConfig(num_workers=4, use_gpu=True, resources_per_worker={'GPU': 1}),\n"
    "             torch_config=TorchConfig(backend='gloo'), run_config=RunConfig(storage_path=_storage)).fit()\n"
)


def start_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2})
    cluster.add_node(num_cpus=1, num_gpus=2)
    cluster.add_node(num_cpus=2, num_gpus=0)
    cluster.wait_for_nodes()
    return cluster


def run(repeats: int) -> None:
    results: dict[str, list[float]] = {}
    have_train = importlib.util.find_spec("ray.train") is not None and importlib.util.find_spec("pandas") is not None
    cluster = start_cluster()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            taas = Kernel(cwd=tmp)
            train = Kernel(load_ext=False, cwd=tmp) if have_train else None
            try:
                assert taas.execute(f"%taas cluster {cluster.address}", timeout=120).reply["status"] == "ok"
                if train is not None:
                    ran = train.execute(RAY_TRAIN_SETUP.format(address=cluster.address), timeout=120)
                    assert ran.reply["status"] == "ok", ran.error_text()
                for _ in range(repeats):
                    first, whole = _time_cell(taas, TAAS_CELL)
                    results.setdefault("taas --gpus 4: first line", []).append(first)
                    results.setdefault("taas --gpus 4: whole", []).append(whole)
                    if train is not None:
                        first, whole = _time_cell(train, RAY_TRAIN_CELL)
                        results.setdefault("Ray Train TorchTrainer(4): first line", []).append(first)
                        results.setdefault("Ray Train TorchTrainer(4): whole", []).append(whole)
            finally:
                taas.shutdown()
                if train is not None:
                    train.shutdown()
    finally:
        cluster.shutdown()
    if not have_train:
        print('[bench] Ray Train: skipped, pip install "ray[train]"')
    med = {name: statistics.median(values) for name, values in results.items()}
    print(f"\nbench/launch.py --cluster: 3-node local Ray cluster (2+2 declared GPUs, 1 CPU node), {repeats} repeats, {STEPS} steps")
    print(f"{'measure':<40} {'median':>9} {'min':>9} {'max':>9}  vs")
    for name, values in results.items():
        other = name.replace("taas --gpus 4", "Ray Train TorchTrainer(4)")
        versus = f"{med[name] / med[other]:.2f}x Ray Train" if other != name and other in med else ""
        print(f"{name:<40} {med[name]:>8.3f}s {min(values):>8.3f} {max(values):>8.3f}  {versus}")
