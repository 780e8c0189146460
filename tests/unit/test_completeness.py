"""A DCP checkpoint's completeness, read from its .metadata without running its pickle (writes/completeness.py),
the sharded checkpoints of taas.save_checkpoint (writes/checkpoints.py), and --shared's folders (writes/rule.py)."""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from taas_magic.writes import checkpoints
from taas_magic.writes.completeness import Ledger, check_dcp, owner, read_parts
from taas_magic.writes.rule import resolve_shared
from taas_magic.writes.savers import CheckpointSaved

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _save(folder, **state) -> None:
    dcp.save(state or {"w": torch.arange(6.0), "note": "hi"}, checkpoint_id=str(folder), no_dist=True)


def test_a_whole_checkpoint_reads_its_parts_and_passes(tmp_path):
    _save(tmp_path / "ck")
    parts = read_parts(str(tmp_path / "ck" / ".metadata"))
    assert list(parts) == ["__0_0.distcp"] and parts["__0_0.distcp"] <= os.path.getsize(tmp_path / "ck" / "__0_0.distcp")
    assert check_dcp(str(tmp_path / "ck"), world_size=1) is None


def test_a_missing_part_is_named_with_its_rank(tmp_path):
    _save(tmp_path / "ck")
    os.rename(tmp_path / "ck" / "__0_0.distcp", tmp_path / "ck" / "elsewhere")
    assert check_dcp(str(tmp_path / "ck"), 1) == ".metadata lists __0_0.distcp (rank 0), missing"


def test_a_short_part_is_named(tmp_path):
    _save(tmp_path / "ck")
    part = tmp_path / "ck" / "__0_0.distcp"
    part.write_bytes(part.read_bytes()[:10])
    problem = check_dcp(str(tmp_path / "ck"), 1)
    assert problem is not None and problem.startswith("shorter than .metadata says: __0_0.distcp (rank 0), 10 of ")


def test_no_metadata_means_the_save_did_not_finish_naming_the_parts_and_the_ranks_without_one(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"x")
    (folder / "__2_0.distcp").write_bytes(b"x")
    assert check_dcp(str(folder), 3) == ("no .metadata: the save did not finish (parts there: __0_0.distcp (rank 0); "
                                         "__2_0.distcp (rank 2); none of rank 1)")


def test_a_folder_rotated_away_is_not_incomplete(tmp_path):
    assert check_dcp(str(tmp_path / "gone"), 2) is None


class Detonator:
    def __reduce__(self):
        return (os.system, ("touch detonated",))


def test_a_metadata_that_names_anything_else_is_refused_and_never_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps({"storage_data": Detonator()}))
    problem = check_dcp(str(folder), 1)
    assert problem is not None and "could not be read: not a DCP .metadata" in problem and "names posix.system" in problem
    assert not (tmp_path / "detonated").exists()


def test_the_ledger_reports_each_incomplete_dcp_folder_once_relative_to_the_repository(tmp_path):
    torn = tmp_path / "ckpt" / "torn"
    torn.mkdir(parents=True)
    (torn / "__1_0.distcp").write_bytes(b"x")
    _save(tmp_path / "ckpt" / "whole")
    ledger = Ledger()
    for rank in (0, 1):
        ledger.saw(rank, CheckpointSaved(str(torn), "torch.distributed.checkpoint", "dcp"))
        ledger.saw(rank, CheckpointSaved(str(tmp_path / "ckpt" / "whole"), "torch.distributed.checkpoint", "dcp"))
    ledger.saw(1, CheckpointSaved(str(tmp_path / "acc"), "accelerate save_state", "files"))
    assert ledger.report(str(tmp_path), 2) == [
        "taas: checkpoint ckpt/torn is incomplete: no .metadata: the save did not finish "
        "(parts there: __1_0.distcp (rank 1); none of rank 0)"]


def test_owner_reads_dcps_naming_only():
    assert (owner("__3_12.distcp"), owner("shard-00001-model.safetensors"), owner(".metadata")) == (3, None, None)


def test_sharded_checkpoints_count_once_whole_and_rotation_drops_torn_ones(tmp_path):
    folder = str(tmp_path / "run")
    first = checkpoints.next_path(folder, sharded=True)
    _save(first)
    assert checkpoints.newest(folder) == first and checkpoints.is_sharded(first)
    torn = checkpoints.next_path(folder, sharded=True)
    os.makedirs(torn)  # a save a killed rank left: no .metadata
    assert checkpoints.newest(folder) == first  # never resumed from
    third = checkpoints.next_path(folder, sharded=True)
    assert os.path.basename(third) == "checkpoint-000003"  # the torn one's number is not reused
    _save(third)
    fourth = checkpoints.save({"step": 4}, folder, keep=2)  # a file after folders
    assert sorted(name for name in os.listdir(folder) if not name.startswith(".")) == \
        ["checkpoint-000003", "checkpoint-000004.pt"]
    assert checkpoints.newest(folder) == fourth
    _save(checkpoints.next_path(folder, sharded=True), w=torch.ones(3))
    whole = checkpoints.load(folder, "cpu")  # no process group: the sharded checkpoint comes back whole
    assert torch.equal(whole["w"], torch.ones(3))
    into = {"w": torch.zeros(3)}
    assert checkpoints.load(folder, "cpu", into=into) is into and torch.equal(into["w"], torch.ones(3))


@pytest.mark.parametrize(("folder", "error"), [
    ("/elsewhere", "--shared /elsewhere: /elsewhere is outside the repository"),
    (".", "--shared .: that is the whole repository"),
    ("../up", "is outside the repository"),
])
def test_shared_folders_must_be_inside_the_repository(tmp_path, folder, error):
    with pytest.raises(ValueError, match=error):
        resolve_shared((folder,), str(tmp_path), str(tmp_path))


def test_shared_folders_resolve_from_the_working_directory(tmp_path):
    (tmp_path / "sub").mkdir()
    assert resolve_shared(("ckpt", "../out"), str(tmp_path), str(tmp_path / "sub")) == \
        (str(tmp_path / "sub" / "ckpt"), str(tmp_path / "out"))


def test_the_diverted_writes_report_leaves_out_the_folders_written_in_place(tmp_path):
    """The overlay's mount points for shared folders stay in rank 1's layer, also once rank 0 rotated the
    folders away: they are not stray writes. A stray write beside them still is."""
    from taas_magic.writes.rule import ScratchLayers

    repository = tmp_path / "repo"
    repository.mkdir()
    layers = ScratchLayers(world_size=2)
    try:
        upper = os.path.join(layers.dirs[1], "upper")
        os.makedirs(os.path.join(upper, "outputs", "checkpoint", "step-1"))  # rotated away by rank 0
        with open(os.path.join(upper, "outputs", "stray.txt"), "w") as stray:
            stray.write("x")
        shared = (str(repository / "outputs" / "checkpoint" / "step-1"),)
        assert layers.report(str(repository), shared) == [
            "taas: rank 1 tried to change 1 path(s) in the repository; diverted and discarded (first: outputs/stray.txt)"]
        assert "first: outputs" in layers.report(str(repository))[0]  # without the shared folders: their mount points too
    finally:
        layers.remove()
