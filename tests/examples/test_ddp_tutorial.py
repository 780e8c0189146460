"""pytorch/examples' DDP tutorial series, ``multigpu_torchrun.py`` (vendored/ddp-tutorial-series): its ``main(...)``
called in a cell, then again with more epochs in a second cell, which resumes from the snapshot rank 0 saved.

The program's loss cannot go down: it takes ``F.cross_entropy`` of one output column against a float target of one
column (class probabilities over a single class), which is 0 for any weights, so SGD never moves them (upstream's
as it is). That makes its resume exact: the second cell's model is the snapshot's to the bit, where a start from
scratch would be a new random ``Linear(20, 1)``.
"""

import re

from tests.examples.conftest import notebook_value, ok, printed, second_cell

CALL = "from multigpu_torchrun import main\nmain(save_every=1, total_epochs={epochs}, batch_size=32)\n"


def _epochs(ran, rank: int) -> list[int]:
    """The epochs rank ``rank`` ran, from the program's ``[GPU<rank>] Epoch <e> | Batchsize: 32 | Steps: 32`` lines."""
    pattern = rf"\[GPU{rank}\] Epoch (\d+) \| Batchsize: 32 \| Steps: 32"
    return [int(m[1]) for line in printed(ran, rank) if (m := re.fullmatch(pattern, line))]


def _saved(ran, rank: int) -> list[int]:
    pattern = r"Epoch (\d+) \| Training snapshot saved at snapshot\.pt"
    return [int(m[1]) for line in printed(ran, rank) if (m := re.fullmatch(pattern, line))]


def test_the_snapshot_rank_0_saved_is_loaded_by_every_rank_in_the_next_cell(kernel, program, pragma):
    program("ddp-tutorial-series")
    first = ok(kernel, f"{pragma}\n{CALL.format(epochs=2)}")
    for rank in (0, 1):
        assert _epochs(first, rank) == [0, 1], first.stream()
        assert "Loading snapshot" not in printed(first, rank)
    assert _saved(first, 0) == [0, 1] and _saved(first, 1) == [], first.stream()  # the program saves on rank 0 only

    # The snapshot loads in the notebook into the program's model, torch.nn.Linear(20, 1).
    ok(kernel, "import torch\nsaved = torch.load('snapshot.pt')\ntorch.nn.Linear(20, 1).load_state_dict(saved['MODEL_STATE'])")
    assert notebook_value(kernel, "saved['EPOCHS_RUN']") == 1

    second = ok(kernel, f"{pragma}\n{CALL.format(epochs=4)}")
    second_cell(second, pragma)
    for rank in (0, 1):  # rank 1 finds and reads the file rank 0 wrote in the first cell
        lines = printed(second, rank)
        assert lines.index("Loading snapshot") < lines.index("Resuming training from snapshot at Epoch 1"), second.stream()
        assert _epochs(second, rank) == [1, 2, 3], second.stream()  # the saved epoch again (upstream's), then on
    assert _saved(second, 0) == [1, 2, 3] and _saved(second, 1) == []
    ok(kernel, "resumed = torch.load('snapshot.pt')")
    assert notebook_value(kernel, "resumed['EPOCHS_RUN']") == 3
    assert notebook_value(kernel, "all(torch.equal(resumed['MODEL_STATE'][k], v) for k, v in saved['MODEL_STATE'].items())")
