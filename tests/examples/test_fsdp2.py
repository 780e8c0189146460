"""pytorch/examples' FSDP2 example (vendored/FSDP2): ``main(args)``'s body pasted in a cell, run twice. Its
``Checkpointer`` lists ``checkpoints/dtensor_api`` on every rank and, when it finds a folder, loads the newest one
(rank 0 saved it: a folder named by the time in ms, the full model and optimizer state dicts) into the sharded model
and optimizer on every rank; then it trains 10 steps and rank 0 saves a new folder. A rank that did not see rank 0's
folder would start from scratch while the other loads: their collectives would not match (a hang, or gloo's error).

What the program shows, asserted: each rank's Adam ``step`` (a plain tensor per rank, not sharded) is 10 after the
first cell and 20 after the second, so every rank resumed the optimizer rank 0 saved; each rank names the folder it
resumed from; each folder's model state loads into the program's ``Transformer``, and the model that comes back to
the notebook is the newest checkpoint's.

Not asserted: its loss going down. ``Transformer.reset_parameters`` resets the embeddings, the last norm and the
output layer but not the ten blocks, which ``model.to_empty`` left as uninitialized memory: on this CPU host their
weights hold whatever was there, and the loss (``model(x).sum()``) is NaN from the first step (upstream's, as it is).
"""

import os

from tests.examples.conftest import VENDORED, function_body, notebook_value, ok, printed, second_cell

# The file's imports and helpers, and its command line's defaults (`torchrun --nproc_per_node 2 example.py`).
SETUP = ("from argparse import Namespace\nfrom example import *\n"
         "args = Namespace(explicit_prefetching=False, mixed_precision=False, dcp_api=False)\n")
# What the cell prints after the program, on each rank: the folder its Checkpointer found, and its optimizer's step.
SHOW = "print('resumed from', checkpointer.last_training_time, 'adam step', int(optim.state_dict()['state'][0]['step']))\n"
FOLDER = "checkpoints/dtensor_api"


def _resumed(ran, rank: int) -> str:
    lines = [line for line in printed(ran, rank) if line.startswith("resumed from ")]
    assert len(lines) == 1, ran.stream()
    return lines[0]


def _checkpoint(kernel, folder: str) -> int:
    """Loads ``folder``'s model state into the program's Transformer in the notebook; its optimizer's steps, once."""
    ok(kernel, f"import torch\nfrom model import Transformer\nloaded = Transformer(model_args)\n"
               f"loaded.load_state_dict(torch.load('{FOLDER}/{folder}/model_state_dict.pt', weights_only=True))\n"
               f"optim_saved = torch.load('{FOLDER}/{folder}/optim_state_dict.pt', weights_only=True)")
    steps = notebook_value(kernel, "sorted({int(state['step']) for state in optim_saved['state'].values()})")
    assert len(steps) == 1, steps
    return steps[0]


def test_every_rank_resumes_from_the_newest_checkpoint_rank_0_saved(kernel, program, pragma):
    repo = program("FSDP2")
    cell = pragma + "\n" + SETUP + function_body(VENDORED / "FSDP2" / "example.py", "main") + SHOW

    fresh = ok(kernel, cell)
    for rank in (0, 1):
        assert _resumed(fresh, rank) == "resumed from None adam step 10", fresh.stream()  # nothing to resume yet
    folders = os.listdir(repo / FOLDER)
    assert len(folders) == 1, folders
    (first,) = folders
    assert _checkpoint(kernel, first) == 10

    second = ok(kernel, cell)
    second_cell(second, pragma)
    for rank in (0, 1):
        assert _resumed(second, rank) == f"resumed from {first} adam step 20", second.stream()
    folders = sorted(os.listdir(repo / FOLDER), key=int)
    assert len(folders) == 2 and folders[0] == first, folders
    assert _checkpoint(kernel, folders[1]) == 20
    # The sharded model came back to the notebook whole: the second folder's weights (NaN where upstream's are).
    assert notebook_value(kernel, "all(torch.equal(v.nan_to_num(), loaded.state_dict()[k].nan_to_num()) "
                                  "for k, v in model.state_dict().items())")
