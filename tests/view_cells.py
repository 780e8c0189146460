"""The cells of the view tests (tests/kernel/test_view.py, tests/ray, tests/slurm): every rank other than 0 looks
every path up first, rank 0 changes each of them (one of each kind of change), every rank says what it sees.

The cell runs in the repository (its working folder); ``expected(rank)`` is what rank ``rank`` must see.
"""

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

# What every rank must see once rank 0 has made its changes (a rank's own writes aside: expected()).
AFTER = {
    "new.txt": "new", "newdir": ["inner"], "newdir/inner": ["a.txt"], "inplace.txt": "v2", "gone.txt": None,
    "before.txt": None, "after.txt": "b", "target.txt": "v2", "ckpt": ["step-1", "step-2"], "both": ["rank0"],
    "both.txt": "rank 0",
}


def expected(rank: int) -> dict:
    """What ``rank`` sees: rank 0's changes, but its own both.txt, and both ranks' entries in the folder both made."""
    return {**AFTER, **({"both": sorted(["rank0", f"rank{rank}"]), "both.txt": f"rank {rank}"} if rank else {})}

LOOK_FIRST = '''
rank = int(os.environ["RANK"])
if rank != 0:  # looks every path up first, writes its own both.txt and both/rankK
    before = {path: look(path) for path in PATHS}
    assert before["new.txt"] is None and before["target.txt"] == "v1" and before["gone.txt"] == "here", before
    os.makedirs("both"); open(f"both/rank{rank}", "w").close()
    with open("both.txt", "w") as f: f.write(f"rank {rank}")
'''




def gathered(pragma: str, world: int) -> str:
    """A fresh cell: rank 0's changes between two barriers, then what every rank saw, gathered as ``seen``."""
    return (
        pragma + "\n"
        "dist.init_process_group('gloo')\n" + LOOK_FIRST +
        "dist.barrier()\n"
        "make_changes(rank)\n"
        "dist.barrier()\n"
        f"seen = [None] * {world}\n"
        "dist.all_gather_object(seen, {path: look(path) for path in PATHS})\n"
        "dist.destroy_process_group()\n"
    )
