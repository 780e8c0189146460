"""pytorch/examples' minGPT-ddp (vendored/minGPT-ddp): a character GPT trained with DDP by its ``Trainer``, which
saves a snapshot (model, optimizer, finished epoch) on rank 0 and, when one is there, loads it on every rank.

Its ``main`` is a ``@hydra.main`` function, which reads the command line: in a notebook the config is composed with
hydra's compose API instead, from the program's own ``gpt2_train_cfg.yaml``, and handed to ``main(cfg)`` (hydra's
decorator calls the function with a config passed to it). Sizes come through the config's overrides only (a small
GPT, a few epochs, no AMP on the CPU, no DataLoader workers). Its data is tiny Shakespeare downloaded from a URL the
config names: here a synthetic text the notebook writes beside it, ``data/input.txt``, and the path overridden.

Asserted from the program's own output: the loss it prints each epoch goes down; rank 0 alone saves the snapshot,
which loads into the program's GPT in the notebook; the second cell resumes on every rank from the epoch saved,
its first loss far below a fresh model's, and its optimizer's step count goes on from the saved one.
"""

import math
import re

import pytest

from tests.examples.conftest import notebook_value, ok, printed, second_cell

pytest.importorskip("hydra")  # hydra-core: the program's config; boto3: trainer.py imports it (for s3:// snapshots)
pytest.importorskip("boto3")

TEXT = "the quick brown fox jumps over the lazy dog. " * 60  # 2700 characters, 28 distinct
OVERRIDES = [
    "data_config.path=data/input.txt", "data_config.block_size=32", "data_config.truncate=1.0",
    "gpt_config.n_layer=2", "gpt_config.n_head=2", "gpt_config.n_embd=32",
    "trainer_config.batch_size=32", "trainer_config.data_loader_workers=0", "trainer_config.save_every=1",
    "trainer_config.use_amp=false", "optimizer_config.learning_rate=0.003",
]
CELL = """import os
from hydra import compose, initialize_config_dir
from main import main
with initialize_config_dir(config_dir=os.getcwd(), version_base=None):
    cfg = compose(config_name="gpt2_train_cfg", overrides={overrides!r})
main(cfg)
"""
# An optimizer step a batch: len(TEXT) - 32 samples, 90% of them for training, halved by the DistributedSampler, 32 to a batch
STEPS_PER_EPOCH = math.ceil(math.ceil(int((len(TEXT) - 32) * 0.9) / 2) / 32)


def _losses(ran, rank: int) -> dict[int, float]:
    """{epoch: loss} from the program's ``[RANK<r>] Epoch <e> | Iter 0 | Train Loss <x>`` lines (one an epoch here)."""
    pattern = rf"\[RANK{rank}\] Epoch (\d+) \| Iter 0 \| Train Loss ([\d.]+)"
    return {int(m[1]): float(m[2]) for line in printed(ran, rank) if (m := re.fullmatch(pattern, line))}


def _saved(ran, rank: int) -> list[int]:
    return [int(m[1]) for line in printed(ran, rank) if (m := re.fullmatch(r"Snapshot saved at epoch (\d+)", line))]


def _snapshot(kernel) -> tuple[int, int]:
    """The snapshot loaded in the notebook into the program's GPT: its finished epoch and its optimizer's step."""
    ok(kernel, "import torch\nfrom model import GPT, GPTConfig\n"
               "snapshot = torch.load('gpt_snapshot.pt', map_location='cpu')\n"
               "gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=28, block_size=32))\n"
               "gpt.load_state_dict(snapshot['model_state'])")
    steps = notebook_value(kernel, "sorted({int(s['step']) for s in snapshot['optimizer_state']['state'].values()})")
    assert len(steps) == 1, steps
    return notebook_value(kernel, "snapshot['finished_epoch']"), steps[0]


def test_the_loss_goes_down_and_a_second_cell_resumes_from_the_snapshot(kernel, program, pragma):
    program("minGPT-ddp")
    ok(kernel, f"os.makedirs('data')\nwith open('data/input.txt', 'w') as f:\n    f.write({TEXT!r})")

    first = ok(kernel, pragma + "\n" + CELL.format(overrides=OVERRIDES + ["trainer_config.max_epochs=3"]))
    for rank in (0, 1):
        assert "Snapshot not found. Training model from scratch" in printed(first, rank), first.stream()
        losses = _losses(first, rank)
        assert sorted(losses) == [1, 2, 3], first.stream()
        # the first is an untrained model's (about ln 28 = 3.3), before its first step
        assert losses[2] < losses[1] and losses[3] < losses[1] / 2, losses
    assert _saved(first, 0) == [1, 2, 3] and _saved(first, 1) == [], first.stream()
    assert _snapshot(kernel) == (3, 3 * STEPS_PER_EPOCH)

    second = ok(kernel, pragma + "\n" + CELL.format(overrides=OVERRIDES + ["trainer_config.max_epochs=5"]))
    second_cell(second, pragma)
    for rank in (0, 1):  # rank 1 reads the snapshot rank 0 saved in the first cell
        assert "Resuming training from snapshot at Epoch 3" in printed(second, rank), second.stream()
        losses = _losses(second, rank)
        assert sorted(losses) == [4, 5], second.stream()
        assert losses[4] < _losses(first, rank)[1] / 2, (losses, _losses(first, rank))  # trained weights, not new ones
    assert _saved(second, 0) == [4, 5] and _saved(second, 1) == []
    assert _snapshot(kernel) == (5, 5 * STEPS_PER_EPOCH)
