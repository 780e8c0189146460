"""Lightning's ``self.log(...)`` in the live chart (taas_magic/rank/lightning.py). The logger on any base: one class per
base, named ``taas``, version 0, hyperparameters ignored, metrics reported without ``epoch``. Then in a real child
process with the real Lightning (skipped where it is not installed): once ``add_to_trainers`` wrapped a Lightning
package (``lightning.pytorch`` or ``pytorch_lightning``), every ``Trainer`` that logs gets one more logger, beside the
cell's own; ``logger=False`` adds none; a cell that passed ``taas.lightning_logger()`` itself does not get a second; a
real ``fit`` reports what the module logs, by step and without ``epoch``.

Wrapping ``Trainer.__init__`` changes Lightning for the whole process, and Lightning takes seconds to import: one child
does all of it and reports as JSON; each test asserts one part."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from taas_magic.rank import lightning as taas_lightning
from tests.unit.rankside import ROOT, WAIT

CHILD = r'''
import json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
from taas_magic.rank import identity, lightning as taas_lightning
root = sys.argv[1]
reports = []
report = lambda step=None, **metrics: reports.append([step, metrics])
identity.enter("cpu", 0, report)
import taas
out = {}

alone = taas_lightning.logger(report)
alone.log_metrics({"loss": 0.5, "epoch": 2}, step=9)
out["alone"] = {"name": alone.name, "version": alone.version, "hyper": alone.log_hyperparams({"lr": 0.1}),
                "is_logger": isinstance(alone, pl.loggers.Logger), "reports": reports[:]}
reports.clear()

taas_lightning.add_to_trainers(pl, report)
def loggers(**kwargs):
    trainer = pl.Trainer(default_root_dir=root, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, accelerator="cpu", devices=1, **kwargs)
    return trainer, [type(each).__name__ for each in trainer.loggers]
out["default"] = loggers()[1]
out["none"] = loggers(logger=False)[1]
out["own"] = loggers(logger=CSVLogger(root))[1]
out["given"] = loggers(logger=[CSVLogger(root), taas.lightning_logger()])[1]


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, index):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("loss", loss)
        self.log("constant", 3.0)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 2)), batch_size=2)
trainer, _ = loggers(logger=CSVLogger(root), max_steps=3, log_every_n_steps=1)
trainer.fit(Module(), data)
out["fit"] = [[step, sorted(metrics), metrics["constant"]] for step, metrics in reports]

import pytorch_lightning
taas_lightning.add_to_trainers(pytorch_lightning, report)
other = pytorch_lightning.Trainer(default_root_dir=root, enable_progress_bar=False, enable_checkpointing=False,
                                  accelerator="cpu", devices=1)
out["pytorch_lightning"] = [isinstance(each, pytorch_lightning.loggers.Logger) and type(each).__name__ for each in other.loggers]
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    pytest.importorskip("lightning")
    ran = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path_factory.mktemp("lightning"))], cwd=ROOT,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True, timeout=WAIT * 3)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return json.loads(ran.stdout.splitlines()[-1])


def test_a_logger_on_any_base_is_one_class_per_base_named_taas_and_reports_without_the_epoch():
    """One class per base: what ``add_to_trainers`` checks so that a Trainer never gets two."""

    class Base:
        pass

    seen: list = []
    first = taas_lightning.logger(lambda step=None, **metrics: seen.append((step, metrics)), Base)
    second = taas_lightning.logger(lambda step=None, **metrics: None, Base)
    assert type(first) is type(second) and isinstance(first, Base)
    first.log_metrics({"loss": 1.0, "acc": 0.5, "epoch": 3}, step=4)
    first.log_metrics({"loss": 0.5})
    assert seen == [(4, {"loss": 1.0, "acc": 0.5}), (None, {"loss": 0.5})]
    assert (first.name, first.version, first.log_hyperparams({"lr": 0.1})) == ("taas", 0, None)


def test_the_logger_alone_reports_what_lightning_logs_but_the_epoch(seen):
    assert seen["alone"] == {"name": "taas", "version": 0, "hyper": None, "is_logger": True,
                             "reports": [[9, {"loss": 0.5}]]}


def test_a_trainer_that_logs_gets_the_taas_logger_beside_its_own(seen):
    assert seen["default"][-1] == "TaasLogger" and len(seen["default"]) == 2  # Lightning's default logger first
    assert seen["own"] == ["CSVLogger", "TaasLogger"]


def test_a_trainer_with_logger_false_gets_none(seen):
    assert seen["none"] == []


def test_a_cell_that_passed_taas_lightning_logger_does_not_get_a_second(seen):
    assert seen["given"] == ["CSVLogger", "TaasLogger"]


def test_a_real_fit_reports_each_logged_step_to_the_chart(seen):
    assert seen["fit"] == [[step, ["constant", "loss"], 3.0] for step in range(3)]


def test_pytorch_lightning_trainers_get_a_pytorch_lightning_logger(seen):
    assert seen["pytorch_lightning"][-1] == "TaasLogger" and all(seen["pytorch_lightning"])
