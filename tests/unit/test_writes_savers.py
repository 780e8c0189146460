"""writes/savers.py: a collective save names its folder, which is then written in place, and the kernel is told.

The savers patch torch's DCP writer, accelerate and the HF Trainer for the whole process, so each test runs
a real interpreter (a "rank" other than 0 under the Python fallback, writes/divert.py) that saves as a cell
would, with real torch and accelerate, and prints the ``CheckpointSaved`` frames it sent and what it said
on stderr; the test then checks where the parts landed: in the repository for the saves' folders, in the
rank's layer for everything else. (The HF Trainer's hook is left to tests/kernel: importing transformers
takes longer than a unit test.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from taas_magic.writes.savers import DCP, CheckpointSaved

PROLOGUE = """
import dataclasses, json, os, sys
from taas_magic.writes import divert, savers
repo, layer, diverted = sys.argv[1], sys.argv[2], sys.argv[3] == "diverted"
sent = []
said = {}
if diverted:
    divert.install(repo, layer)
os.chdir(repo)
"""


def _rank(repo, layer, code: str, diverted: bool = True) -> tuple[list[CheckpointSaved], dict, str]:
    """Run ``code`` in a rank; the frames it sent, what it put in ``said``, and its stderr."""
    script = (PROLOGUE + textwrap.dedent(code)
              + "\nprint(json.dumps([[dataclasses.asdict(frame) for frame in sent], said]))\n")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", script, str(repo), str(layer),
                           "diverted" if diverted else "rank 0"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr
    frames, said = json.loads(done.stdout.splitlines()[-1])
    return [CheckpointSaved(**frame) for frame in frames], said, done.stderr


@pytest.fixture()
def repo(tmp_path):
    root = tmp_path / "repo"
    root.mkdir()
    (root / "notes.txt").write_text("a file, not a folder")
    return root


def test_a_shared_folder_is_made_in_the_repository_written_in_place_and_told_once_per_layout(repo, tmp_path):
    frames, said, err = _rank(repo, tmp_path / "layer", """
        savers.install(sent.append, folders=("out",))
        said["first"] = savers.share("ckpt/step1", "my saver")
        savers.share(os.path.join(repo, "ckpt", "step1"), "my saver")   # the same folder, absolute: not told again
        savers.share("ckpt/step1", "my saver", layout=savers.DCP_LAYOUT)  # another layout: told
        savers.install(sent.append, folders=("out", "more"))            # a kept rank's next cell
        for folder in ("ckpt/step1", "out", "more"):
            with open(os.path.join(folder, "part-1"), "w") as f:
                f.write(folder)
        with open("elsewhere.txt", "w") as f:
            f.write("diverted")
    """)
    assert said == {"first": str(repo / "ckpt" / "step1")}
    assert frames == [CheckpointSaved(str(repo / "out"), "--shared", "files"),
                      CheckpointSaved(str(repo / "ckpt" / "step1"), "my saver", "files"),
                      CheckpointSaved(str(repo / "ckpt" / "step1"), "my saver", "dcp"),
                      CheckpointSaved(str(repo / "more"), "--shared", "files")]
    for folder in ("ckpt/step1", "out", "more"):
        assert (repo / folder / "part-1").read_text() == folder  # in place
    assert not (repo / "elsewhere.txt").exists() and (tmp_path / "layer" / "upper" / "elsewhere.txt").exists()
    assert err == ""


def test_rank_0_names_its_folders_all_the_same(repo, tmp_path):
    frames, said, _ = _rank(repo, tmp_path / "layer", """
        savers.install(sent.append)
        said["returned"] = savers.share("ckpt", savers.DCP, savers.DCP_LAYOUT)
    """, diverted=False)
    assert frames == [CheckpointSaved(str(repo / "ckpt"), DCP, "dcp")]
    assert said == {"returned": str(repo / "ckpt")}


def test_a_folder_that_cannot_be_shared_is_said_once_and_the_cell_goes_on(repo, tmp_path):
    frames, said, err = _rank(repo, tmp_path / "layer", """
        savers.install(sent.append, folders=("notes.txt/ckpt",))  # under a file: no folder can be made there
        said["went_on"] = True
    """)
    assert said == {"went_on": True} and frames == []
    lines = err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("taas: --shared into notes.txt/ckpt: this rank's part could not be written in place (")
    assert "Not a directory" in lines[0] and lines[0].endswith("; it stays in the rank's private layer")


def test_finish_waits_for_pending_saves_and_says_a_failed_one_without_raising(tmp_path):
    frames, said, err = _rank(tmp_path, tmp_path / "layer", """
        import concurrent.futures, threading, time
        savers.finish()  # nothing pending: nothing said
        slow, failed = concurrent.futures.Future(), concurrent.futures.Future()
        failed.set_exception(ValueError("disk full"))
        savers._pending.extend([slow, failed])
        threading.Timer(0.3, slow.set_result, ["written"]).start()
        started = time.monotonic()
        savers.finish()
        said["waited"] = slow.done() and time.monotonic() - started >= 0.25
        said["emptied"] = savers._pending == []
    """, diverted=False)
    assert said["waited"] is True and said["emptied"] is True
    assert err.splitlines() == ["taas: waiting for 1 async checkpoint save(s) to finish",
                                "taas: an async checkpoint save failed: ValueError: disk full"]


def test_dcp_saves_name_their_folders_and_their_parts_land_in_the_repository(repo, tmp_path):
    layer = tmp_path / "layer"
    frames, said, err = _rank(repo, layer, """
        savers.install(sent.append)
        import torch
        import torch.distributed.checkpoint as dcp
        state = {"w": torch.arange(4.0)}
        dcp.save(state, checkpoint_id="ckpt/step1")
        dcp.save(state, storage_writer=dcp.FileSystemWriter("ckpt/step2"))
        future = dcp.async_save(state, checkpoint_id="ckpt/async")
        savers.finish()  # the cell ended: the async save is whole
        said["async_done"] = future.done()
        torch.save(state, "model.pt")  # not a collective save: diverted as ever
        loaded = {"w": torch.zeros(4)}
        dcp.load(loaded, checkpoint_id="ckpt/step2")
        said["loaded"] = loaded["w"].tolist()
    """)
    assert frames == [CheckpointSaved(str(repo / "ckpt" / "step1"), DCP, "dcp"),
                      CheckpointSaved(str(repo / "ckpt" / "step2"), DCP, "dcp"),
                      CheckpointSaved(str(repo / "ckpt" / "async"), DCP, "dcp")]
    assert said == {"async_done": True, "loaded": [0.0, 1.0, 2.0, 3.0]}
    for step in ("step1", "step2", "async"):
        assert sorted(os.listdir(repo / "ckpt" / step)) == [".metadata", "__0_0.distcp"], step
    assert not (repo / "model.pt").exists() and (layer / "upper" / "model.pt").exists()
    assert [line for line in err.splitlines() if line.startswith("taas:")] in (
        [], ["taas: waiting for 1 async checkpoint save(s) to finish"])


def test_accelerates_save_state_names_its_output_folder(repo, tmp_path):
    layer = tmp_path / "layer"
    frames, said, err = _rank(repo, layer, """
        savers.install(sent.append)
        import torch
        from accelerate import Accelerator
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(torch.nn.Linear(2, 2))
        accelerator.save_state("runs/state")
        said["saved"] = sorted(os.listdir("runs/state"))
    """)
    assert frames == [CheckpointSaved(str(repo / "runs" / "state"), "accelerate save_state", "files")]
    assert "random_states_0.pkl" in said["saved"]
    assert sorted(os.listdir(repo / "runs" / "state")) == said["saved"]  # every file in place, none in the layer
    assert not any(files for _, _, files in os.walk(layer / "upper"))  # no file in the layer (the folder made first, at most)
    assert "taas:" not in err

