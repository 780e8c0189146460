"""writes/divert.py: the Python fallback's patched functions, in a rank process of their own.

:func:`install` patches ``builtins.open``, ``os`` and ``shutil`` for the whole process, so each test runs a
real interpreter (a "rank") that installs the diversion over a real repository under ``tmp_path``, does what
a cell would, and prints what it saw as JSON; the test then checks that and the files on disk: the rank
reads back its own writes, the repository never changes, and what was written is in ``changes.log``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from taas_magic.writes.divert import Diversion
from tests.unit.rankside import said_by

PROLOGUE = """
import errno, io, json, os, pathlib, shutil, stat, sys
from taas_magic.writes import divert
repo, layer = sys.argv[1], sys.argv[2]
said = {}
def fails(call, *args):
    try:
        call(*args)
    except OSError as exc:
        return [type(exc).__name__, exc.errno]
    return None
diversion = divert.install(repo, layer)
os.chdir(repo)
"""


def _rank(repo, layer, code: str) -> dict:
    """Run ``code`` in a rank whose writes under ``repo`` are diverted to ``layer``; what it put in ``said``."""
    return said_by(PROLOGUE, code, str(repo), str(layer), timeout=120)


@pytest.fixture()
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "data" / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("v1")
    (root / "data" / "x.csv").write_text("1,2\n")
    (root / "data" / "sub" / "y").write_text("y")
    return root


def _tree(root) -> dict[str, str]:
    """Every file under ``root`` with its text: the repository's state, to compare before and after."""
    found = {}
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, root)] = Path(path).read_text() if os.path.isfile(path) else ""
    return found


def _changes(layer) -> list[str]:
    return (layer / "changes.log").read_text().splitlines()


def test_new_files_overwrites_and_appends_are_the_ranks_own_and_the_repository_is_untouched(repo, tmp_path):
    layer = tmp_path / "layer"
    before = _tree(repo)
    said = _rank(repo, layer, """
        with open("a.txt", "a") as f:          # an append copies the repository's file up first
            f.write("+rank1")
        said["a"] = open("a.txt").read()
        pathlib.Path("new.txt").write_text("pathlib")
        said["new"] = pathlib.Path("new.txt").read_text()
        with io.open("data/x.csv", "w") as f:  # an overwrite starts empty
            f.write("9\\n")
        said["x"] = open("data/x.csv").read()
        with open("data/x.csv", "r+") as f:    # r+ updates in place: copied up (already there) and kept
            f.seek(0, 2)
            f.write("10\\n")
        said["x2"] = open("data/x.csv").read()
        shutil.copy("a.txt", "copy.txt")
        said["copy"] = open("copy.txt").read()
        said["exists"] = [os.path.exists("new.txt"), os.path.isfile("copy.txt")]
        said["listed"] = sorted(os.listdir("."))
        said["excl"] = fails(open, "new.txt", "x")
        said["listdir_file"] = [fails(os.listdir, "new.txt"), fails(os.listdir, "data/x.csv")]
    """)
    assert said == {"a": "v1+rank1", "new": "pathlib", "x": "9\n", "x2": "9\n10\n", "copy": "v1+rank1",
                    "exists": [True, True], "listed": ["a.txt", "copy.txt", "data", "new.txt"],
                    "excl": ["FileExistsError", 17], "listdir_file": [["NotADirectoryError", 20]] * 2}
    assert _tree(repo) == before
    assert (layer / "upper" / "a.txt").read_text() == "v1+rank1" and (layer / "upper" / "new.txt").exists()
    assert _changes(layer) == ["a.txt", "new.txt", os.path.join("data", "x.csv"), "copy.txt"]


def test_os_open_diverts_by_its_flags(repo, tmp_path):
    layer = tmp_path / "layer"
    said = _rank(repo, layer, """
        fd = os.open("a.txt", os.O_RDONLY)
        said["read"] = os.read(fd, 10).decode(); os.close(fd)
        fd = os.open("a.txt", os.O_WRONLY | os.O_APPEND)  # no O_TRUNC: the repository's bytes copied up
        os.write(fd, b"-more"); os.close(fd)
        fd = os.open("fresh.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, b"\\x00\\x01"); os.close(fd)
        said["a"] = open("a.txt").read()
        said["fresh_mode"] = stat.S_IMODE(os.stat("fresh.bin").st_mode)
        dir_fd = os.open("data/sub", os.O_RDONLY)  # dir_fd= is not covered: it writes the repository itself
        fd = os.open("through-dir-fd.txt", os.O_WRONLY | os.O_CREAT, dir_fd=dir_fd)
        os.close(fd); os.close(dir_fd)
    """)
    assert said == {"read": "v1", "a": "v1-more", "fresh_mode": 0o600}
    assert (repo / "a.txt").read_text() == "v1" and not (repo / "fresh.bin").exists()
    assert (layer / "upper" / "fresh.bin").read_bytes() == b"\x00\x01"
    assert (repo / "data" / "sub" / "through-dir-fd.txt").exists()  # the documented gap: the header names the mode


def test_deletes_leave_the_repository_and_hide_the_path_from_the_rank(repo, tmp_path):
    layer = tmp_path / "layer"
    before = _tree(repo)
    said = _rank(repo, layer, """
        os.remove("a.txt")
        said["a"] = [os.path.exists("a.txt"), fails(open, "a.txt"), fails(os.remove, "a.txt"), fails(os.stat, "a.txt")]
        said["rmdir_full"] = fails(os.rmdir, "data")
        os.unlink("data/sub/y")
        os.rmdir("data/sub")
        said["data"] = sorted(os.listdir("data"))
        shutil.rmtree("data")
        said["after_rmtree"] = [os.path.exists("data/x.csv"), fails(os.listdir, "data"), sorted(os.listdir("."))]
        said["listdir_missing"] = fails(os.listdir, "never-was")
        said["rmtree_missing"] = fails(shutil.rmtree, "data")
        said["remove_missing"] = fails(os.remove, "never-was")
    """)
    assert said == {"a": [False, ["FileNotFoundError", 2], ["FileNotFoundError", 2], ["FileNotFoundError", 2]],
                    "rmdir_full": ["OSError", 39], "data": ["x.csv"],
                    "after_rmtree": [False, ["FileNotFoundError", 2], []],
                    "listdir_missing": ["FileNotFoundError", 2], "rmtree_missing": ["FileNotFoundError", 2],
                    "remove_missing": ["FileNotFoundError", 2]}
    assert _tree(repo) == before
    assert set(_changes(layer)) == {"a.txt", os.path.join("data", "sub", "y"), os.path.join("data", "sub"), "data"}


def test_a_folder_cleared_and_made_again_starts_empty(repo, tmp_path):
    """``shutil.rmtree(out); os.makedirs(out)``, as a script cleans its output folder: nothing of the old comes back."""
    said = _rank(repo, tmp_path / "layer", """
        shutil.rmtree("data")
        os.makedirs("data/sub")
        said["data"] = sorted(os.listdir("data"))
        said["sub"] = os.listdir("data/sub")
        said["old"] = [os.path.exists("data/x.csv"), os.path.exists("data/sub/y")]
        open("data/new.csv", "w").close()
        said["data2"] = sorted(os.listdir("data"))
    """)
    assert said == {"data": ["sub"], "sub": [], "old": [False, False], "data2": ["new.csv", "sub"]}
    assert (repo / "data" / "x.csv").exists()


def test_renames_and_replaces_move_in_the_ranks_view_only(repo, tmp_path):
    layer = tmp_path / "layer"
    outside = tmp_path / "outside.txt"
    outside.write_text("from outside")
    before = _tree(repo)
    said = _rank(repo, layer, f"""
        with open("ckpt.tmp", "w") as f:
            f.write("v2")
        os.replace("ckpt.tmp", "a.txt")      # the atomic save onto an existing name
        said["a"] = [open("a.txt").read(), os.path.exists("ckpt.tmp")]
        os.rename("data", "moved")           # a folder of the repository
        said["moved"] = [sorted(os.listdir("moved")), open("moved/sub/y").read(), os.path.exists("data")]
        shutil.move("moved/x.csv", "x-moved.csv")
        said["shutil_move"] = [open("x-moved.csv").read(), os.path.exists("moved/x.csv")]
        os.rename({str(outside)!r}, "in.txt")  # into the repository from outside: moved into the layer
        said["in"] = open("in.txt").read()
        os.mkdir("d")
        said["onto_dir"] = fails(os.rename, "in.txt", "d")
        said["missing"] = fails(os.rename, "nothing", "b")
    """)
    assert said == {"a": ["v2", False], "moved": [["sub", "x.csv"], "y", False], "shutil_move": ["1,2\n", False],
                    "in": "from outside", "onto_dir": ["IsADirectoryError", 21], "missing": ["FileNotFoundError", 2]}
    assert _tree(repo) == before
    assert not outside.exists() and (layer / "upper" / "in.txt").read_text() == "from outside"


def test_mkdir_chmod_and_stat_see_the_layer_over_the_repository(repo, tmp_path):
    layer = tmp_path / "layer"
    mode = stat.S_IMODE(os.stat(repo / "a.txt").st_mode)
    said = _rank(repo, layer, """
        said["mkdir_existing"] = [fails(os.mkdir, "data"), fails(os.mkdir, "a.txt")]
        os.makedirs("made/deep")
        said["made"] = [os.path.isdir("made/deep"), sorted(os.listdir("."))]
        os.makedirs("data/sub", exist_ok=True)
        os.chmod("a.txt", 0o600)
        said["mode"] = stat.S_IMODE(os.stat("a.txt").st_mode)
        said["content"] = open("a.txt").read()   # chmod copied the file up with its content
        said["chmod_missing"] = fails(os.chmod, "nothing", 0o600)
        said["lstat_missing"] = fails(os.lstat, "nothing")
    """)
    assert said == {"mkdir_existing": [["FileExistsError", 17], ["FileExistsError", 17]],
                    "made": [True, ["a.txt", "data", "made"]], "mode": 0o600, "content": "v1",
                    "chmod_missing": ["FileNotFoundError", 2], "lstat_missing": ["FileNotFoundError", 2]}
    assert stat.S_IMODE(os.stat(repo / "a.txt").st_mode) == mode and not (repo / "made").exists()


def test_paths_outside_the_repository_and_links_into_it_are_written_as_they_are(repo, tmp_path):
    layer = tmp_path / "layer"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(repo, tmp_path / "link")
    said = _rank(repo, layer, f"""
        with open({str(elsewhere / "out.txt")!r}, "w") as f:
            f.write("out")
        os.remove({str(elsewhere / "out.txt")!r})
        os.mkdir({str(elsewhere / "dir")!r})
        with open({str(tmp_path / "link" / "via-link.txt")!r}, "w") as f:  # not followed: documented, not diverted
            f.write("through the link")
        said["listed"] = os.listdir({str(elsewhere)!r})
    """)
    assert said == {"listed": ["dir"]}
    assert (elsewhere / "dir").is_dir() and not (elsewhere / "out.txt").exists()
    assert (repo / "via-link.txt").read_text() == "through the link"
    assert not (layer / "changes.log").exists()


def test_torch_save_imported_after_install_is_diverted_too(repo, tmp_path):
    """torch.save's C++ writer opens the file itself: the path is diverted before it is handed over."""
    layer = tmp_path / "layer"
    said = _rank(repo, layer, """
        import torch
        torch.save({"w": torch.arange(3)}, "model.pt")
        torch.serialization.save(torch.ones(2), pathlib.Path("data") / "t.pt")
        buffer = io.BytesIO()
        torch.save(torch.zeros(1), buffer)         # a file object is not a path: untouched
        said["loaded"] = torch.load("model.pt")["w"].tolist()
        said["t"] = torch.load("data/t.pt").tolist()
        said["buffer"] = len(buffer.getvalue()) > 0
        said["patched"] = torch.save is torch.serialization.save and torch.save.__name__ == "save"
    """)
    assert said == {"loaded": [0, 1, 2], "t": [1.0, 1.0], "buffer": True, "patched": True}
    assert not (repo / "model.pt").exists() and not (repo / "data" / "t.pt").exists()
    assert (layer / "upper" / "model.pt").stat().st_size > 0
    assert _changes(layer) == ["model.pt", os.path.join("data", "t.pt")]


def test_a_diversion_made_in_this_process_resolves_through_its_layer_without_patching(repo, tmp_path):
    """:class:`Diversion` alone (no :func:`install`) sends each call through the layer: its ``open``."""
    diversion = Diversion(str(repo), str(tmp_path / "layer"))
    with diversion.open(str(repo / "a.txt"), "a") as handle:
        handle.write("!")
    with diversion.open(str(repo / "a.txt")) as handle:
        assert handle.read() == "v1!"
    assert (repo / "a.txt").read_text() == "v1"
    assert diversion.listdir(str(repo)) == ["a.txt", "data"]
    with diversion.open(str(tmp_path / "plain.txt"), "w") as handle:
        handle.write("plain")
    assert (tmp_path / "plain.txt").read_text() == "plain"
