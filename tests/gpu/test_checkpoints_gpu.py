"""Lightning's FSDPStrategy with a sharded checkpoint: it refuses CPU ("requires a GPU accelerator"), so it is
tested here, on 2 GPUs (skipped without them). Every rank writes its DCP part of the checkpoint's folder and rank 0
adds meta.pt; the repository gets all of them (writes/savers.py), and the kernel finds the checkpoint whole.
Written without a GPU to run it on: the first session lent one runs it (the CPU twin, ModelParallelStrategy, is
tests/kernel/test_checkpoints_frameworks.py)."""

import os

import pytest
import torch

from tests.kernel_client import Kernel, assert_nothing_left

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

CELL = """#pragma taas --gpus 2
import lightning as L, torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy
from torch.utils.data import DataLoader, TensorDataset

class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 4)), batch_size=8)
checkpoints = ModelCheckpoint(dirpath="ckpt", filename="step{step}", every_n_train_steps=2, save_top_k=-1)
trainer = L.Trainer(accelerator="cuda", devices=2, strategy=FSDPStrategy(state_dict_type="sharded"), max_steps=4,
                    callbacks=[checkpoints], logger=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Regressor(), loader)
"""


def test_lightning_fsdp_sharded_checkpoint_lands_whole(tmp_path):
    kernel = Kernel(cwd=str(tmp_path))
    try:
        (tmp_path / ".git").mkdir()
        assert kernel.execute(f"%taas config repo {tmp_path}").reply["status"] == "ok"
        ran = kernel.execute(CELL, timeout=300)
        assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
        assert "incomplete" not in ran.stream("stderr"), ran.stream("stderr")
        folders = sorted(os.listdir(tmp_path / "ckpt"))
        assert folders, ran.stream()
        for folder in folders:
            names = set(os.listdir(tmp_path / "ckpt" / folder))
            assert {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"} <= names, (folder, sorted(names))
        assert_nothing_left(kernel)
    finally:
        kernel.shutdown()
