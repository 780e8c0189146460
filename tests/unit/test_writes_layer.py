"""writes/layer.py: where a rank under the Python fallback reads and writes each path of the repository.

:class:`Layer` patches nothing, so it runs here in pytest's own process, over a real repository and a real
layer folder under ``tmp_path``; every answer it gives is checked against the files it leaves on disk
(the upper copies, the repository untouched, ``changes.log``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from taas_magic.writes.layer import Layer, inside, inside_any

pytestmark = pytest.mark.unpinned  # pure Python over real files: nothing of the minimums' pins (.ci/run)


@pytest.fixture()
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "data" / "deep").mkdir(parents=True)
    (root / "a.txt").write_text("repository's a")
    (root / "data" / "x.bin").write_bytes(b"xx")
    (root / "data" / "deep" / "y").write_text("y")
    return root


@pytest.fixture()
def layer(repo, tmp_path):
    return Layer(str(repo), str(tmp_path / "layer"))


def _log(tmp_path) -> list[str]:
    return (tmp_path / "layer" / "changes.log").read_text().splitlines()


@pytest.mark.parametrize(("path", "root", "expected"), [
    ("/r", "/r", True),
    ("/r/a", "/r", True),
    ("/r/a/b", "/r", True),
    ("/rx", "/r", False),  # a sibling whose name starts with the root's is not under it
    ("/", "/r", False),
    ("/r", "/r/a", False),
])
def test_inside_is_the_root_or_below_it_never_a_sibling_with_the_same_prefix(path, root, expected):
    assert inside(path, root) is expected


def test_inside_any_takes_dot_as_the_whole_repository():
    assert inside_any("ckpt/step1/part", ("logs", "ckpt"))
    assert not inside_any("ckpt2/part", ("ckpt",))
    assert inside_any("anything/at/all", ("logs", "."))
    assert not inside_any("a", ())


def test_paths_outside_the_repository_descriptors_and_non_paths_are_not_the_layers(layer, repo, tmp_path):
    assert layer.relative(str(repo / "data" / "x.bin")) == os.path.join("data", "x.bin")
    assert layer.relative(repo) == "."  # a PathLike, the repository itself
    assert layer.relative(os.fsencode(str(repo / "a.txt"))) == "a.txt"  # bytes too
    assert layer.relative(str(tmp_path / "elsewhere.txt")) is None
    assert layer.relative(str(repo) + "-sibling/a.txt") is None
    assert layer.relative(3) is None  # a descriptor
    assert layer.relative(None) is None
    assert layer.relative(str(tmp_path / "layer" / "upper" / "a.txt")) is None


def test_a_relative_path_is_taken_from_the_working_directory(layer, repo, monkeypatch):
    monkeypatch.chdir(repo / "data")
    assert layer.relative("deep/y") == os.path.join("data", "deep", "y")
    assert layer.relative("../a.txt") == "a.txt"
    assert layer.relative("../../outside") is None


def test_a_symbolic_link_from_outside_into_the_repository_is_not_followed(layer, repo, tmp_path):
    os.symlink(repo, tmp_path / "link")
    assert layer.relative(str(tmp_path / "link" / "a.txt")) is None
    assert layer.for_writing(str(tmp_path / "link" / "a.txt"), copy_up=True) == str(tmp_path / "link" / "a.txt")
    assert not os.path.exists(tmp_path / "layer" / "changes.log")


def test_a_layer_inside_the_repository_is_never_its_own(repo):
    layer = Layer(str(repo), str(repo / ".taas" / "layer"))
    assert layer.relative(str(repo / ".taas" / "layer" / "upper" / "a.txt")) is None
    assert layer.relative(str(repo / ".taas" / "other")) == os.path.join(".taas", "other")


def test_a_path_never_written_is_read_in_the_repository(layer, repo):
    path = str(repo / "a.txt")
    assert layer.for_reading(path) == path
    outside = "/somewhere/else"
    assert layer.for_reading(outside) is outside


def test_a_write_goes_to_the_upper_copy_and_is_read_back_from_there(layer, repo, tmp_path):
    target = layer.for_writing(str(repo / "new" / "file.txt"), copy_up=False)
    assert target == str(tmp_path / "layer" / "upper" / "new" / "file.txt")
    assert os.path.isdir(os.path.dirname(target)) and not os.path.exists(target)  # its folder made, not the file
    with open(target, "w") as handle:
        handle.write("rank 1's")
    assert layer.for_reading(str(repo / "new" / "file.txt")) == target
    assert not (repo / "new").exists()
    assert _log(tmp_path) == [os.path.join("new", "file.txt")]


def test_copy_up_brings_the_file_or_the_tree_as_it_was_and_only_once(layer, repo, tmp_path):
    upper = tmp_path / "layer" / "upper"
    target = layer.for_writing(str(repo / "a.txt"), copy_up=True)
    assert Path(target).read_text() == "repository's a"
    with open(target, "a") as handle:
        handle.write(", appended")
    assert layer.for_writing(str(repo / "a.txt"), copy_up=True) == target  # the upper copy is not made again
    assert Path(target).read_text() == "repository's a, appended"
    assert (repo / "a.txt").read_text() == "repository's a"
    tree = layer.for_writing(str(repo / "data"), copy_up=True)
    assert sorted(os.listdir(tree)) == ["deep", "x.bin"] and (upper / "data" / "deep" / "y").read_text() == "y"
    assert not os.path.exists(layer.for_writing(str(repo / "b.txt"), copy_up=True))  # nothing to copy: nothing made
    assert _log(tmp_path) == ["a.txt", "data", "b.txt"]  # each path once, in the order written


def test_a_write_without_copy_up_starts_empty(layer, repo):
    target = layer.for_writing(str(repo / "a.txt"), copy_up=False)
    assert not os.path.exists(target)


def test_a_delete_leaves_a_tombstone_that_hides_the_repositorys_file_and_everything_under_a_folder(layer, repo, tmp_path):
    layer.for_writing(str(repo / "a.txt"), copy_up=True)
    layer.delete(str(repo / "a.txt"), is_dir=False)
    assert not os.path.lexists(tmp_path / "layer" / "upper" / "a.txt")  # the upper copy removed
    assert not os.path.exists(layer.for_reading(str(repo / "a.txt")))
    layer.delete(str(repo / "data"), is_dir=True)
    for gone in ("data", "data/x.bin", "data/deep/y"):
        assert not os.path.exists(layer.for_reading(str(repo / gone))), gone
    assert layer.is_deleted(os.path.join("data", "deep")) and not layer.is_deleted("data2")
    assert (repo / "a.txt").exists() and (repo / "data" / "deep" / "y").exists()  # the repository never changes
    assert _log(tmp_path) == ["a.txt", "data"]


def test_a_path_written_again_after_its_delete_is_the_ranks_new_one(layer, repo):
    layer.delete(str(repo / "a.txt"), is_dir=False)
    target = layer.for_writing(str(repo / "a.txt"), copy_up=True)  # appending to a deleted file: it starts empty
    assert not os.path.exists(target)
    with open(target, "w") as handle:
        handle.write("again")
    assert layer.for_reading(str(repo / "a.txt")) == target and not layer.is_deleted("a.txt")


def test_a_folder_deleted_and_made_again_is_empty_as_without_taas(layer, repo):
    """``shutil.rmtree(out); os.makedirs(out)``: what the repository's folder held stays deleted."""
    layer.delete(str(repo / "data"), is_dir=True)
    os.mkdir(layer.for_writing(str(repo / "data"), copy_up=False))
    with open(layer.for_writing(str(repo / "data" / "fresh"), copy_up=False), "w") as handle:
        handle.write("new")
    assert layer.names("data", os.listdir) == ["fresh"]
    assert not os.path.exists(layer.for_reading(str(repo / "data" / "x.bin")))
    assert not os.path.exists(layer.for_reading(str(repo / "data" / "deep" / "y")))
    os.mkdir(layer.for_writing(str(repo / "data" / "deep"), copy_up=False))  # a subfolder made again: empty too
    assert layer.names(os.path.join("data", "deep"), os.listdir) == []


def test_a_folders_entries_are_the_repositorys_and_the_uppers_less_the_deleted(layer, repo):
    open(layer.for_writing(str(repo / "data" / "mine"), copy_up=False), "w").close()
    layer.delete(str(repo / "data" / "x.bin"), is_dir=False)
    assert layer.names("data", os.listdir) == ["deep", "mine"]
    assert layer.names(".", os.listdir) == ["a.txt", "data"]
    os.makedirs(layer.for_writing(str(repo / "only-mine" / "sub"), copy_up=False))
    assert layer.names("only-mine", os.listdir) == ["sub"]  # a folder the repository lacks (yet)
    assert layer.names("nowhere", os.listdir) == []
    assert layer.names("a.txt", os.listdir) == []  # not a folder
    layer.delete(str(repo / "data"), is_dir=True)
    assert layer.names("data", os.listdir) == []
    assert layer.names(".", os.listdir) == ["a.txt", "only-mine"]


def test_a_shared_folder_is_written_in_place_not_in_the_layer(layer, repo, tmp_path):
    layer.shared = ("ckpt",)
    part = str(repo / "ckpt" / "__1_0.distcp")
    assert layer.relative(part) is None
    assert layer.for_writing(part, copy_up=False) == part
    assert layer.relative(str(repo / "ckpt2" / "x")) == os.path.join("ckpt2", "x")
    layer.shared = (".",)
    assert layer.for_writing(str(repo / "a.txt"), copy_up=True) == str(repo / "a.txt")
    assert not (tmp_path / "layer" / "changes.log").exists()
