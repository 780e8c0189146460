"""A PyTorch Lightning cell trains on exactly N processes with no init call."""

import pytest

pytest.importorskip("lightning")

REGRESSOR = """\
class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.seen = 0  # samples this rank trained on
    def training_step(self, batch, _):
        x, y = batch
        self.seen += len(x)
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


def _dataset_in_the_notebook(kernel, tmp_path) -> None:
    """64 random regression samples and a root folder for Lightning, as notebook names."""
    kernel.execute(
        "import torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        f"root = {str(tmp_path)!r}\n"
        "dataset = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))"
    )


def test_lightning_ddp_trains_on_exactly_n_processes(kernel, tmp_path):
    _dataset_in_the_notebook(kernel, tmp_path)
    ran = kernel.execute(
        """#pragma taas --device cpu --gpus 2 --output all
import os
import lightning as L
import torch

{regressor}
trainer = L.Trainer(devices=2, strategy="ddp", max_epochs=2, default_root_dir=root, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
module = Regressor()
trainer.fit(module, DataLoader(dataset, batch_size=8))
print(f"FIT pid={{os.getpid()}} global_rank={{trainer.global_rank}} world={{trainer.world_size}} steps={{trainer.global_step}}")
""".format(regressor=REGRESSOR)
    )
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    fits = [line for line in ran.stream("stdout").splitlines() if "FIT" in line]
    assert len(fits) == 2, ran.stream()
    assert len({line.split("pid=")[1].split()[0] for line in fits}) == 2
    assert sorted(line.split("global_rank=")[1].split()[0] for line in fits) == ["0", "1"]
    assert all("world=2" in line for line in fits)
    # DistributedSampler halves each rank's data: 64 / 8 / 2 = 4 steps an epoch, 2 epochs.
    assert all("steps=8" in line for line in fits)
    # The trained module comes back (the trainer too, though its properties read the ranks' environment).
    after = kernel.execute("print(type(module).__name__, tuple(module.layer.weight.shape), type(trainer).__name__)")
    assert after.stream("stdout") == "Regressor (1, 8) Trainer\n", after.error_text()


def test_lightning_trains_on_a_registered_loader_with_data_workers(kernel, tmp_path):
    kernel.execute(
        "import torch, taas\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        f"root = {str(tmp_path)!r}\n"
        "train_loader = taas.register(DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=8, shuffle=True))"
    )
    try:
        ran = kernel.execute(
            """#pragma taas --device cpu --gpus 2 --cpus 2 --output all
import lightning as L
import torch

{regressor}
trainer = L.Trainer(devices=2, strategy="ddp", max_epochs=3, default_root_dir=root, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
module = Regressor()
trainer.fit(module, train_loader)
print(f"FIT global_rank={{trainer.global_rank}} steps={{trainer.global_step}} seen={{module.seen}}")
""".format(regressor=REGRESSOR)
        )
        assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
        fits = sorted(line for line in ran.stream("stdout").splitlines() if "FIT" in line)
        # 8 elements a pass, 4 per rank, 3 epochs (the last two replayed): 12 steps of 8 samples.
        assert fits == [f"[rank {r}] FIT global_rank={r} steps=12 seen=96" for r in (0, 1)], ran.stream()
    finally:
        kernel.execute("taas.unregister(train_loader)")


def test_what_self_log_logs_is_drawn_in_the_chart_with_no_change_to_the_cell(kernel, tmp_path):
    _dataset_in_the_notebook(kernel, tmp_path)
    ran = kernel.execute(
        """#pragma taas --device cpu --gpus 2
import lightning as L
import torch

class Logged(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

trainer = L.Trainer(devices=2, strategy="ddp", max_epochs=3, default_root_dir=root, log_every_n_steps=1,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Logged(), DataLoader(dataset, batch_size=8))
loggers = [type(each).__name__ for each in trainer.loggers]
"""
    )
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    charts = [message.content for message in ran.messages if message.type in ("display_data", "update_display_data")
              and message.content.get("transient", {}).get("display_id", "").startswith("taas-chart-")]
    assert len(charts) >= 2 and ">train_loss</text>" in charts[-1]["data"]["image/svg+xml"]
    # 64 / 8 / 2 = 4 steps an epoch, 3 epochs, logged every step; the cell's own logger is kept
    logged = kernel.execute("import taas\n([m['step'] for m in taas.metrics()], sorted(taas.metrics()[0]), loggers)")
    steps, keys, loggers = eval(logged.result["text/plain"])  # noqa: S307 - our own repr
    assert steps == list(range(12)) and keys == ["step", "train_loss"]
    assert loggers[-1] == "TaasLogger" and len(loggers) == 2
