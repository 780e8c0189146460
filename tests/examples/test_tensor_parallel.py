"""pytorch/examples' tensor parallel example, ``tensor_parallel_example.py`` (vendored/tensor_parallelism): a script
with no ``main``, pasted whole into a cell. It builds a 1-D device mesh over the 2 ranks (gloo on the CPU), shards
a two-layer MLP Megatron-style (``ColwiseParallel``, then ``RowwiseParallel``) and takes 10 AdamW steps on
``output.sum()`` with the same input on every rank. It saves no checkpoint, so there is nothing to resume in fresh
ranks; in kept ranks a second cell runs its training loop again on the model and optimizer the first one left (rank
0's sharded model stays sharded in the rank while a whole copy comes back to the notebook: transfer/unshard.py's
Rebuild on new objects for kept ranks; before, the names-back gather made it plain in place and the second cell hung).

Asserted: rank 0's log of the 10 iterations; the model coming back to the notebook whole (its DTensors gathered);
the objective of the last iteration (``output.sum()``, an untrained model's being of order 1 for inputs in [0, 1))
far below zero; after a second kept cell, lower again, with AdamW's step going on from 10 to 20.
"""

import ast

from tests.examples.conftest import CELL, VENDORED, notebook_value, ok, printed

SCRIPT = VENDORED / "tensor_parallelism" / "tensor_parallel_example.py"


def _training_loop() -> str:
    """The script's ``num_iters = 10`` and its training loop: what a person pastes to train again."""
    source = SCRIPT.read_text()
    nodes = ast.parse(source).body
    start = next(i for i, node in enumerate(nodes) if isinstance(node, ast.Assign) and ast.unparse(node) == "num_iters = 10")
    loop = next(node for node in nodes[start:] if isinstance(node, ast.For))
    return "\n".join(source.splitlines()[nodes[start].lineno - 1:loop.end_lineno]) + "\n"


def _iterations(ran) -> list[int]:
    done = [line.split("Tensor Parallel iter ")[1] for line in printed(ran, 0) if "Tensor Parallel iter " in line]
    return [int(entry.split()[0]) for entry in done]


def _trained(kernel, ran) -> float:
    """What the script shows, asserted; the objective of its last iteration (``output.sum()``, in the notebook)."""
    for rank in (0, 1):
        assert f"Starting PyTorch TP example on rank {rank}." in printed(ran, rank), ran.stream()
    assert _iterations(ran) == list(range(10)), ran.stream()
    assert any(line.endswith("Tensor Parallel training completed!") for line in printed(ran, 0))
    assert "tp_model: ToyModel, came back whole (4 DTensors gathered from 2 ranks" in ran.stream()
    assert notebook_value(kernel, "[type(p).__name__ for p in tp_model.parameters()]") == ["Parameter"] * 4
    objective = notebook_value(kernel, "output.sum().item()")
    assert objective < -100, objective
    return objective


def test_the_sharded_mlp_trains_and_comes_back_whole(kernel, program, pragma):
    program("tensor_parallelism")
    _trained(kernel, ok(kernel, pragma + "\n" + SCRIPT.read_text()))


def test_a_second_kept_cell_trains_the_kept_sharded_mlp_on(kernel, program):
    program("tensor_parallelism")
    kept = CELL + " --keep"
    objective = _trained(kernel, ok(kernel, kept + "\n" + SCRIPT.read_text()))
    second = ok(kernel, kept + "\n" + _training_loop())
    assert _iterations(second) == list(range(10)), second.stream()
    assert notebook_value(kernel, "output.sum().item()") < objective  # the same last input, 10 steps further on
    again = ok(kernel, kept + "\nprint('adam step', int(optimizer.state_dict()['state'][0]['step']))")
    assert printed(again, 0)[-1] == printed(again, 1)[-1] == "adam step 20", again.stream()
