"""Every rank sees the repository as rank 0 has left it: after a collective, and at every cell's start.

Each kind of change (a new file or folder, a change in place, a deletion, a rename, ``os.replace`` onto an
existing name, an entry added to a folder) is made by rank 0 between two barriers, after rank 1 looked the
path up first: the overlay's look-up-first case, where its cache kept rank 1 from ever seeing the change.
Both isolation modes (the ``mode`` fixture), fresh and kept ranks. The cell gathers what every rank saw
(``all_gather_object``) and rank 0's ``seen`` comes back to the notebook.
"""

import pytest

from tests.kernel_client import assert_nothing_left
from tests.view_cells import CHANGES, LOOK_FIRST, expected, gathered


def _seen_by_rank(k, rank: int) -> dict:
    ran = k.execute(f"print(repr(seen[{rank}]))")
    assert ran.reply["status"] == "ok", ran.error_text()
    return eval(ran.stream("stdout").strip())  # noqa: S307 - the test's own repr of str/list/None


def _expect(seen: dict, rank: int) -> None:
    assert seen == expected(rank), f"rank {rank} saw {seen}"


def test_every_rank_sees_rank_0s_changes_after_a_barrier_even_paths_it_looked_up_first(kernel, repo, mode):
    kernel.execute(CHANGES + "seed()")
    ran = kernel.execute(gathered("#pragma taas --gpus 2 --device cpu", 2))
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    for rank in (0, 1):
        _expect(_seen_by_rank(kernel, rank), rank)


@pytest.fixture()
def kept(kernel, repo):
    yield kernel
    ran = kernel.execute("%taas release")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert_nothing_left(kernel)


def test_kept_ranks_see_at_a_cells_start_what_rank_0_wrote_after_the_last_collective(kept, mode):
    """The issue's fourth row: rank 0 changes the repository in one kept cell after its last collective (and the
    notebook itself between cells); the next kept cell sees it on every rank, before any collective of its own."""
    kept.execute(CHANGES + "seed()")
    first = kept.execute(
        "#pragma taas --gpus 2 --device cpu --keep\n"
        "dist.init_process_group('gloo')\n" + LOOK_FIRST +
        "notebook_made = look('from-the-notebook.txt')\n"
        "dist.barrier()\n"
        "make_changes(rank)\n"  # no collective after it in this cell
    )
    assert first.reply["status"] == "ok", first.error_text() + first.stream()
    kept.execute("with open('from-the-notebook.txt', 'w') as f: f.write('between cells')")
    second = kept.execute(
        "#pragma taas --gpus 2 --device cpu --keep\n"
        "mine = {path: look(path) for path in PATHS + ('from-the-notebook.txt',)}\n"  # before any collective
        "seen = [None, None]\n"
        "dist.all_gather_object(seen, mine)\n"
    )
    assert second.reply["status"] == "ok", second.error_text() + second.stream()
    for rank in (0, 1):
        seen = _seen_by_rank(kept, rank)
        assert seen.pop("from-the-notebook.txt") == "between cells", rank
        _expect(seen, rank)
