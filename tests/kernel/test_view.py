"""Every rank sees the repository as rank 0 has left it: after a collective, and at every cell's start.

Each kind of change (a new file or folder, a change in place, a deletion, a rename, ``os.replace`` onto an
existing name, an entry added to a folder) is made by rank 0 between two barriers, after rank 1 looked the
path up first: the overlay's look-up-first case, where its cache kept rank 1 from ever seeing the change.
Both isolation modes (the ``mode`` fixture), fresh and kept ranks. The cell gathers what every rank saw
(``all_gather_object``) and rank 0's ``seen`` comes back to the notebook.
"""

import pytest

from tests.kernel_client import assert_nothing_left

CHANGES = '''
import os, torch.distributed as dist

def look(path):
    """What a rank sees at ``path``: missing, a folder's sorted entries, or a file's text."""
    if not os.path.exists(path):
        return None
    if os.path.isdir(path):
        return sorted(os.listdir(path))
    with open(path) as handle:
        return handle.read()

def make_changes(rank):
    """Rank 0's changes, one of each kind, to paths rank 1 has looked at already."""
    if rank != 0:
        return
    with open("new.txt", "w") as f: f.write("new")                    # a new file
    os.makedirs("newdir/inner"); open("newdir/inner/a.txt", "w").close()  # new folders
    with open("inplace.txt", "r+") as f: f.write("v2")                # a change in place (the same inode)
    os.remove("gone.txt")                                             # a deletion
    os.rename("before.txt", "after.txt")                              # a rename to a new name
    with open("target.txt.tmp", "w") as f: f.write("v2")
    os.replace("target.txt.tmp", "target.txt")                        # the atomic save onto an existing name
    open("ckpt/step-2", "w").close()                                  # an entry added to a folder
    os.makedirs("both"); open("both/rank0", "w").close()              # a folder rank 1 made too
    with open("both.txt", "w") as f: f.write("rank 0")                # a path rank 1 wrote too

PATHS = ("new.txt", "newdir", "newdir/inner", "inplace.txt", "gone.txt", "before.txt", "after.txt",
         "target.txt", "ckpt", "both", "both.txt")

def seed():
    """The repository before: made by the notebook itself."""
    for name, text in (("inplace.txt", "v1"), ("gone.txt", "here"), ("before.txt", "b"), ("target.txt", "v1")):
        with open(name, "w") as f: f.write(text)
    os.makedirs("ckpt", exist_ok=True)
    open("ckpt/step-1", "w").close()
'''

# What every rank must see once rank 0 has made its changes; rank 1's own write of both.txt shadows rank 0's
# for rank 1 only, and the folder both made shows both ranks' entries there.
AFTER = {
    "new.txt": "new", "newdir": ["inner"], "newdir/inner": ["a.txt"], "inplace.txt": "v2", "gone.txt": None,
    "before.txt": None, "after.txt": "b", "target.txt": "v2", "ckpt": ["step-1", "step-2"], "both": ["rank0"],
    "both.txt": "rank 0",
}
RANK_1_OWN = {"both": ["rank0", "rank1"], "both.txt": "rank 1"}

LOOK_FIRST = '''
rank = int(os.environ["RANK"])
if rank == 1:  # looks every path up first, writes its own both.txt and both/rank1
    before = {path: look(path) for path in PATHS}
    assert before["new.txt"] is None and before["target.txt"] == "v1" and before["gone.txt"] == "here", before
    os.makedirs("both"); open("both/rank1", "w").close()
    with open("both.txt", "w") as f: f.write("rank 1")
'''


def _seen_by_rank(k, rank: int) -> dict:
    ran = k.execute(f"print(repr(seen[{rank}]))")
    assert ran.reply["status"] == "ok", ran.error_text()
    return eval(ran.stream("stdout").strip())  # noqa: S307 - the test's own repr of str/list/None


def _expect(seen: dict, rank: int) -> None:
    assert seen == {**AFTER, **(RANK_1_OWN if rank == 1 else {})}, f"rank {rank} saw {seen}"


def test_every_rank_sees_rank_0s_changes_after_a_barrier_even_paths_it_looked_up_first(kernel, repo, mode):
    kernel.execute(CHANGES + "seed()")
    ran = kernel.execute(
        "#pragma taas --gpus 2 --device cpu\n"
        "dist.init_process_group('gloo')\n" + LOOK_FIRST +
        "dist.barrier()\n"
        "make_changes(rank)\n"
        "dist.barrier()\n"
        "seen = [None, None]\n"
        "dist.all_gather_object(seen, {path: look(path) for path in PATHS})\n"
        "dist.destroy_process_group()\n"
    )
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
