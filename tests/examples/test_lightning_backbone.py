"""Lightning's backbone image classifier example, ``examples/pytorch/basics/backbone_image_classifier.py``
(vendored/lightning-backbone): a ``LightningCLI`` program (a ``LitClassifier`` around an MLP ``Backbone``, a
``MyDataModule``), trained with DDP on 2 CPU ranks, then resumed in a second cell with ``ckpt_path="last"``.

``cli_main()``'s body is pasted in the cell after ``sys.argv`` is set to the command line (``LightningCLI`` parses
``sys.argv``, as ``python backbone_image_classifier.py ...`` would give it), so every size and the resume come
through the program's own arguments: ``--trainer.accelerator=cpu --trainer.devices=2 --trainer.strategy=ddp``, a few
batches per epoch (``--trainer.limit_*_batches``), ``--trainer.max_epochs``, a ``ModelCheckpoint`` with
``save_last=true`` in ``checkpoints/`` (``--trainer.callbacks+=ModelCheckpoint ...``) and a learning rate of 0.001
(``--model.learning_rate``). The second cell is the same body with ``--trainer.max_epochs=4`` and its ``fit`` call
given ``ckpt_path="last"``. MNIST is downloaded by the program: here a synthetic stand-in of MNIST's shape and
sizes takes its place (vendored/lightning-backbone/synthetic_mnist.py, SOURCE.md).

Asserted from what the program produces: rank 0's ``checkpoints/last.ckpt`` (epoch and step, its weights load
into the program's ``LitClassifier`` in the notebook); the CSV logger's ``lightning_logs/version_N/metrics.csv``,
whose training loss goes down each epoch, on after the resume (epochs 2 and 3, their steps going on from 16), and
whose test loss after 4 epochs is below the one after 2; Lightning's own lines saying it restored ``last.ckpt``.
Every rank ends at step 32: a rank that had not seen the ``last.ckpt`` rank 0 saved would have trained 4 epochs
from scratch against the other's 2, and their gradient all-reduces would not have matched.
"""

import csv
import io

import pytest

from tests.examples.conftest import VENDORED, function_body, notebook_value, ok, printed, second_cell

pytest.importorskip("lightning")
pytest.importorskip("jsonargparse")  # LightningCLI's parser (lightning's [pytorch-extra])

PROGRAM = VENDORED / "lightning-backbone" / "backbone_image_classifier.py"
ARGS = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp",
        "--trainer.limit_train_batches=8", "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2",
        "--trainer.limit_predict_batches=1", "--trainer.enable_progress_bar=false",
        "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.dirpath=checkpoints",
        "--trainer.callbacks.save_last=true", "--model.learning_rate=0.001"]
STEPS = 8  # optimizer steps an epoch on every rank: --trainer.limit_train_batches
FIT = "cli.trainer.fit(cli.model, datamodule=cli.datamodule)"
# What the cell prints after the program, on each rank: where its trainer ended.
SHOW = "print('trained to epoch', cli.trainer.current_epoch, 'step', cli.trainer.global_step)\n"


def _cell(pragma: str, epochs: int, resume: bool) -> str:
    body = function_body(PROGRAM, "cli_main")
    assert body.count(FIT) == 1, body
    if resume:
        body = body.replace(FIT, FIT[:-1] + ', ckpt_path="last")')
    argv = ["backbone_image_classifier.py", *ARGS, f"--trainer.max_epochs={epochs}"]
    return f"{pragma}\nimport sys\nsys.argv = {argv!r}\nfrom backbone_image_classifier import *\n{body}{SHOW}"


def _trained(ran, rank: int) -> str:
    """The SHOW line of rank ``rank`` (one; by its start: Lightning's own lines, on stderr, may come after it)."""
    lines = [line for line in printed(ran, rank) if line.startswith("trained to epoch ")]
    assert len(lines) == 1, ran.stream()
    return lines[0]


def _metrics(kernel, version: int) -> tuple[dict[int, float], dict[int, int], float]:
    """From the CSV logger's metrics.csv: {epoch: training loss}, {epoch: step it was logged at}, the test loss."""
    text = notebook_value(kernel, f"open('lightning_logs/version_{version}/metrics.csv').read()")
    rows = list(csv.DictReader(io.StringIO(text)))
    trained = [row for row in rows if row["train_loss_epoch"]]
    (test,) = [float(row["test_loss"]) for row in rows if row["test_loss"]]
    return ({int(r["epoch"]): float(r["train_loss_epoch"]) for r in trained},
            {int(r["epoch"]): int(r["step"]) for r in trained}, test)


def _last(kernel) -> tuple[int, int]:
    """``checkpoints/last.ckpt`` loaded in the notebook into the program's LitClassifier: its epoch and step."""
    ok(kernel, "import torch\nfrom backbone_image_classifier import LitClassifier\n"
               "last = torch.load('checkpoints/last.ckpt', weights_only=False)\n"
               "LitClassifier().load_state_dict(last['state_dict'])")
    return notebook_value(kernel, "(last['epoch'], last['global_step'])")


def test_the_loss_goes_down_and_a_second_cell_resumes_from_last_ckpt(kernel, program, pragma):
    repo = program("lightning-backbone")

    first = ok(kernel, _cell(pragma, epochs=2, resume=False))
    for rank in (0, 1):
        assert _trained(first, rank) == f"trained to epoch 2 step {2 * STEPS}", first.stream()
    assert "`Trainer.fit` stopped: `max_epochs=2` reached." in printed(first, 0), first.stream()
    assert not any("last.ckpt" in line for line in printed(first, 0)), first.stream()  # nothing to resume from
    assert sorted(p.name for p in (repo / "checkpoints").iterdir()) == [f"epoch=1-step={2 * STEPS}.ckpt", "last.ckpt"]
    assert _last(kernel) == (1, 2 * STEPS)
    losses, steps, tested = _metrics(kernel, 0)
    assert steps == {0: STEPS - 1, 1: 2 * STEPS - 1}, steps
    assert losses[1] < losses[0], losses  # the first epoch's mean includes an untrained model's

    second = ok(kernel, _cell(pragma, epochs=4, resume=True))
    second_cell(second, pragma)
    lines = printed(second, 0)
    restored = f"Restored all states from the checkpoint at {repo}/checkpoints/last.ckpt"
    assert f"Restoring states from the checkpoint path at {repo}/checkpoints/last.ckpt" in lines, second.stream()
    assert restored in lines and "`Trainer.fit` stopped: `max_epochs=4` reached." in lines, second.stream()
    for rank in (0, 1):
        assert _trained(second, rank) == f"trained to epoch 4 step {4 * STEPS}", second.stream()
    assert sorted(p.name for p in (repo / "checkpoints").iterdir()) == [f"epoch=3-step={4 * STEPS}.ckpt", "last.ckpt"]
    assert _last(kernel) == (3, 4 * STEPS)
    resumed, steps, tested_again = _metrics(kernel, 1)
    assert steps == {2: 3 * STEPS - 1, 3: 4 * STEPS - 1}, steps  # the epochs and steps go on from the saved ones
    assert resumed[3] < resumed[2] < losses[1], (losses, resumed)  # trained weights, going on down
    assert tested_again < tested, (tested, tested_again)
