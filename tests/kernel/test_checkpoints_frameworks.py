"""Each framework's own collective save lands whole, in both isolation modes (writes/savers.py).

Every test runs the framework's save, unchanged, in a real 2-rank CPU cell (gloo) of a real kernel
with a scratch repository, then looks at what landed there and loads it:

- accelerate's ``Accelerator.save_state``: every rank's ``random_states_{i}.pkl``, and rank 1's
  random stream restored by ``load_state`` in the next cell; with automatic checkpoint naming and a
  ``total_limit``, rank 0's rotation leaves the newest folders whole;
- the HF ``Trainer``: every rank's ``rng_state_{i}.pth`` in each ``checkpoint-N``;
- Lightning's ``ModelParallelStrategy`` (FSDP2): its sharded checkpoint, rotated by
  ``ModelCheckpoint(save_top_k=1)``, whole when read in the notebook (``FSDPStrategy`` needs CUDA);
- torchtitan's layout without torchtitan: ``dcp.save`` into ``outputs/checkpoint/step-N`` on every
  rank, and rank 0 purging all but the newest ``keep_latest_k`` with ``shutil.rmtree``.

Without the saver's hook (writes/savers.py), rank 1's part of each stays in its private layer and is
thrown away: each test fails then. Two more pin what the Python layer got wrong when rank 1 ran
ahead of rank 0: listing a folder it made that the repository lacked (accelerate's rotation), and
sharing a folder whose parent the repository lacked (a DCP save by a group without rank 0).
Rank 1's values are read from its own output (``--output all``). A framework's first import in a
kernel takes most of a test's time (about 10 s for Lightning or the Trainer on 2 busy cores).
"""

import ast
import os

import pytest

from tests.collective_save import FSDP_MODEL
from tests.kernel.test_write_rule import HEADERS

CELL = "#pragma taas --device cpu --gpus 2 --output all\n"


def _ok(ran, mode: str) -> None:
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    assert HEADERS[mode] in ran.stream("stdout")
    assert "incomplete" not in ran.stream("stderr"), ran.stream("stderr")


def _printed(ran, rank: int, label: str) -> object:
    """What ``rank`` printed after ``label`` (one line, a Python literal)."""
    prefix = f"[rank {rank}] {label} "
    lines = [line[len(prefix):] for line in ran.stream("stdout").splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, ran.stream()
    return ast.literal_eval(lines[0])


def _files(folder) -> list[str]:
    return sorted(os.listdir(folder))


# -- accelerate -------------------------------------------------------------------------------------
ACCELERATOR = """
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(**config))
net = torch.nn.Linear(4, 2)
model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
"""


def test_accelerate_save_state_lands_every_ranks_random_states_and_load_state_resumes_rank_1(kernel, repo, mode):
    pytest.importorskip("accelerate")
    saved = kernel.execute(
        CELL + "config = {}\n" + ACCELERATOR
        + "torch.manual_seed(100 + accelerator.process_index)\n"  # each rank its own stream
        "accelerator.save_state('ckpt/acc')\n"
        "print('after save', torch.rand(3).tolist())\n"
        "del accelerator, net, model, optimizer\n"
    )
    _ok(saved, mode)
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= set(_files(repo / "ckpt" / "acc"))

    resumed = kernel.execute(
        CELL + "config = {}\n" + ACCELERATOR
        + "torch.manual_seed(7)\n"  # the same stream on both ranks, unless load_state gives each its own back
        "accelerator.load_state('ckpt/acc')\n"
        "print('after load', torch.rand(3).tolist())\n"
        "del accelerator, net, model, optimizer\n"
    )
    _ok(resumed, mode)
    for rank in (0, 1):
        assert _printed(resumed, rank, "after load") == _printed(saved, rank, "after save"), (rank, resumed.stream())
    assert _printed(saved, 0, "after save") != _printed(saved, 1, "after save")


def test_accelerate_rotation_by_rank_0_keeps_the_newest_checkpoints_whole(kernel, repo, mode):
    pytest.importorskip("accelerate")
    ran = kernel.execute(
        CELL + "config = dict(project_dir='proj', automatic_checkpoint_naming=True, total_limit=2)\n" + ACCELERATOR
        + "for save in range(3):\n"
        "    accelerator.save_state()\n"  # proj/checkpoints/checkpoint_{0,1,2}; rank 0 removes the oldest
        "del accelerator, net, model, optimizer\n"
    )
    _ok(ran, mode)
    checkpoints = repo / "proj" / "checkpoints"
    assert _files(checkpoints) == ["checkpoint_1", "checkpoint_2"], ran.stream()
    for kept in ("checkpoint_1", "checkpoint_2"):
        assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= set(_files(checkpoints / kept))


def test_a_rank_lists_a_folder_it_made_that_the_repository_lacks(kernel, repo, mode):
    # What accelerate's rotation does on every rank (os.makedirs, then os.listdir) before rank 0 made the folder:
    # the Python layer listed the repository's folder, which was not there.
    ran = kernel.execute(
        CELL + "import os, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "mine = f'made-by-{dist.get_rank()}'\n"
        "os.makedirs(f'{mine}/inner')\n"
        "print('listed', sorted(os.listdir(mine)))\n"
        "dist.destroy_process_group()\n"
    )
    _ok(ran, mode)
    assert _printed(ran, 0, "listed") == _printed(ran, 1, "listed") == ["inner"]
    assert _files(repo) == [".git", "made-by-0"]


def test_a_save_by_a_group_without_rank_0_lands_in_a_folder_the_repository_lacked(kernel, repo, mode):
    # A pipeline stage's group saving its own checkpoint: rank 0 never makes the folder, so rank 1 must make
    # it in the repository itself (the Python layer made it in the layer, and DCP's mkdir then failed).
    ran = kernel.execute(
        CELL + "import os, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp\n"
        "dist.init_process_group('gloo')\n"
        "alone = dist.new_group([1])\n"
        "if dist.get_rank() == 1:\n"
        "    dcp.save({'w': torch.arange(6.0)}, checkpoint_id='stage1/ckpt', process_group=alone)\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    _ok(ran, mode)
    assert _files(repo / "stage1" / "ckpt") == [".metadata", "__0_0.distcp"]
    check = kernel.execute(
        "import torch\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "dcp_to_torch_save('stage1/ckpt', 'stage1.pt')\n"
        "print(torch.load('stage1.pt')['w'].tolist())"
    )
    assert check.stream("stdout") == "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]\n", check.error_text()


# -- the HF Trainer ---------------------------------------------------------------------------------
TRAINER = """
import torch
from transformers import Trainer, TrainingArguments

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.layer(x), labels)}

class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        generator = torch.Generator().manual_seed(i)
        return {"x": torch.randn(4, generator=generator), "labels": torch.randn(1, generator=generator)}

args = TrainingArguments(output_dir="out", max_steps=4, save_steps=2, use_cpu=True, report_to=[], per_device_train_batch_size=4,
                         logging_strategy="no", disable_tqdm=True, ddp_find_unused_parameters=False)
trainer = Trainer(model=Tiny(), args=args, train_dataset=Pairs())
trainer.train()
world = args.world_size
del trainer, args
"""


def test_hf_trainer_checkpoints_hold_every_ranks_rng_state(kernel, repo, mode):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # the Trainer needs it
    ran = kernel.execute(CELL + TRAINER, timeout=240)
    _ok(ran, mode)
    assert _files(repo / "out") == ["checkpoint-2", "checkpoint-4"], ran.stream()
    for checkpoint in ("checkpoint-2", "checkpoint-4"):
        files = _files(repo / "out" / checkpoint)
        assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors", "trainer_state.json"} <= set(files), files
    check = kernel.execute(
        "import torch\n"
        "states = [torch.load(f'out/checkpoint-4/rng_state_{rank}.pth', weights_only=False) for rank in range(world)]\n"
        "print('rng states', world, [sorted(state) for state in states])"
    )
    assert check.stream("stdout") == "rng states 2 [['cpu', 'numpy', 'python'], ['cpu', 'numpy', 'python']]\n", \
        check.error_text()


# -- Lightning --------------------------------------------------------------------------------------
LIGHTNING = """
import torch
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)
    def configure_model(self):
        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])
    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
every_2 = ModelCheckpoint(dirpath="ckpt", filename="step{step}", auto_insert_metric_name=False, every_n_train_steps=2, save_top_k=1)
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), max_steps=4, logger=False, callbacks=[every_2],
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=".")
module = Regressor()
trainer.fit(module, DataLoader(dataset, batch_size=8))
full = {name: tensor.full_tensor() for name, tensor in module.state_dict().items()}
del trainer, every_2, module
"""


def test_lightning_model_parallel_sharded_checkpoint_lands_whole_after_its_rotation(kernel, repo, mode):
    pytest.importorskip("lightning")
    ran = kernel.execute(CELL + LIGHTNING, timeout=240)
    _ok(ran, mode)
    assert _files(repo / "ckpt") == ["step4.ckpt"], ran.stream()  # step2.ckpt rotated away by rank 0
    assert _files(repo / "ckpt" / "step4.ckpt") == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    check = kernel.execute(
        "import torch\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "dcp_to_torch_save('ckpt/step4.ckpt', 'lightning.pt')\n"
        "whole = torch.load('lightning.pt', weights_only=False)['state_dict']\n"
        "assert sorted(whole) == sorted(full), (sorted(whole), sorted(full))\n"
        "assert all(torch.equal(whole[name], full[name]) for name in full)\n"
        "print('lightning', sorted(full))"
    )
    assert check.stream("stdout") == "lightning ['layer.bias', 'layer.weight']\n", check.error_text()


# -- torchtitan's layout ----------------------------------------------------------------------------
TORCHTITAN = FSDP_MODEL + """\
import re, shutil
folder, keep_latest_k, saved = "outputs/checkpoint", 2, {}
for step in range(1, 6):
    optimizer.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(folder, f"step-{step}"))
    saved[step] = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
    if dist.get_rank() == 0:  # torchtitan's _purge_stale_checkpoints, on rank 0 only
        found = sorted((int(re.search(r"step-(\\d+)", name).group(1)), os.path.join(folder, name)) for name in os.listdir(folder))
        for _, path in found[:-keep_latest_k]:
            shutil.rmtree(path, ignore_errors=True)
dist.destroy_process_group()
del model, optimizer, mesh
"""


def test_torchtitan_layout_keeps_the_newest_k_whole_and_the_purged_gone(kernel, repo, mode):
    ran = kernel.execute(CELL + TORCHTITAN)
    _ok(ran, mode)
    assert _files(repo / "outputs" / "checkpoint") == ["step-4", "step-5"], ran.stream()
    # the overlay's mount points for the shared folders, rotated away by rank 0, are not stray writes
    assert "tried to change" not in ran.stream("stderr") and "incomplete" not in ran.stream("stderr"), ran.stream()
    for step in ("step-4", "step-5"):
        assert _files(repo / "outputs" / "checkpoint" / step) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    check = kernel.execute(
        "import torch\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "for step in (4, 5):\n"
        "    dcp_to_torch_save(f'outputs/checkpoint/step-{step}', f'step-{step}.pt')\n"
        "    whole = torch.load(f'step-{step}.pt')['model']\n"
        "    assert sorted(whole) == sorted(saved[step]), (sorted(whole), sorted(saved[step]))\n"
        "    assert all(torch.equal(whole[name], saved[step][name]) for name in whole), step\n"
        "assert not any(torch.equal(saved[4][name], saved[5][name]) for name in saved[4])\n"
        "print('torchtitan', sorted(saved), len(saved[5]))"
    )
    assert check.stream("stdout") == "torchtitan [1, 2, 3, 4, 5] 4\n", check.error_text()
