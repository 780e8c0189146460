"""Hugging Face accelerate's gradient synchronization program, ``test_sync.py`` (vendored/accelerate-sync): the
script accelerate's own CI runs on 2 CPU processes (``debug_launcher(test_sync.main)``) and its docs run with
``accelerate launch``. Its model is accelerate's ``RegressionModel`` (``y = a * x + b``, two parameters, defined in
``accelerate.test_utils.training``) on its ``RegressionDataset``: nothing downloaded.

``main()`` trains a DDP copy of the model beside a plain one fed every rank's batch (gathered), and asserts after
each backward that their gradients agree exactly when they should: outside ``no_sync``, after the last of several
backwards under ``trigger_sync_in_backward``, and at the end of each ``accumulate`` window of 2 with an AdamW and a
scheduler stepping. A rank whose gradients were not averaged with the other's fails there. It prints a header on
rank 0 before each part, and ``RegressionModel`` prints its dtypes at its first forward.

The cell sets ``ACCELERATE_USE_CPU=yes``, what ``accelerate launch --cpu`` sets: without it accelerate takes a
process on a host with no GPU for a program alone (``DistributedType.NO``) even where ``WORLD_SIZE`` is 2, as under
``torchrun``, and the program runs its one-process part instead on each rank.

Asserted: rank 0's headers, the distributed ones (not the one-process ``NOOP`` one), in order; the six models each
rank built printing; accelerate's state on each rank, printed after the program: a 2-process ``MULTI_CPU`` group.
A second cell runs the program again: on the kept ranks (their process group kept, though the program destroys its
group at its end) or on new ones.
"""

from tests.examples.conftest import ok, printed, second_cell

CELL = """import os
os.environ["ACCELERATE_USE_CPU"] = "yes"  # what `accelerate launch --cpu` sets
from test_sync import main
main()
from accelerate.state import PartialState
print("accelerate:", PartialState().distributed_type, PartialState().num_processes, PartialState().process_index)
"""
HEADERS = [
    "**Test `accumulate` gradient accumulation with dataloader break**",
    "**Test Distributed `no_sync` context manager**",
    "**Test Distributed `no_sync` context manager with multiple forwards**",
    "**Test `accumulate` gradient accumulation with optimizer and scheduler,  `split_batches=False`, "
    "`dispatch_batches=False`, `sync_each_batch=False`**",
]
DTYPES = "Model dtype: torch.float32, torch.float32. Input dtype: torch.float32"


def _ran_distributed(ran) -> None:
    assert [line for line in printed(ran, 0) if line.startswith("**")] == HEADERS, ran.stream()
    assert not any(line.startswith("**") for line in printed(ran, 1)), ran.stream()  # headers are rank 0's
    for rank in (0, 1):
        # a model and its DDP copy in each of the three trainings
        assert printed(ran, rank).count(DTYPES) == 6, ran.stream()
        # the line the cell prints after the program (picked by its start: a warning, on stderr, may come after it)
        assert [line for line in printed(ran, rank) if line.startswith("accelerate: ")] == \
            [f"accelerate: DistributedType.MULTI_CPU 2 {rank}"], ran.stream()


def test_ddp_gradients_sync_exactly_when_the_program_says(kernel, program, pragma):
    program("accelerate-sync")
    _ran_distributed(ok(kernel, f"{pragma}\n{CELL}"))
    second = ok(kernel, f"{pragma}\n{CELL}")
    second_cell(second, pragma)
    _ran_distributed(second)
