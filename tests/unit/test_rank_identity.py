"""Whether a process is a rank, and what ``import taas`` answers by (taas_magic/rank/identity.py): the defaults
anywhere but a rank (not a rank, no worker info, the CPU, reports ignored, no checkpoint saved but one error that
says where to save instead), and, once the rank bootstrap called ``enter``, torch's ``WorkerInfo`` from the rank's
variables and the run's seed, ``taas.report`` reaching the rank's reporter, the rank's own device, rank 0's
checkpoints saved, rotated, found and loaded back (the others' saves return None), and which objects hold DTensors
(a sharded save).

Entering a rank is process state (the module's globals, RANK, a process group), so all of it happens in one fresh
child interpreter per test file, which checks the defaults first, then enters, and reports what it saw as JSON; each
test asserts one part of that report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from taas_magic.rank import identity  # noqa: F401 - the module under test, exercised in the child below
from tests.unit.rankside import ROOT, WAIT

CHILD = r'''
import json, os, sys
from taas_magic.rank import identity
folder, store = sys.argv[1], sys.argv[2]
out = {}
for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
    os.environ.pop(name, None)

# -- anywhere but a rank: the defaults
out["before"] = {"in_rank": identity.in_rank(), "info": identity.get_worker_info(),
                 "report_ignored": identity.reporter is identity.ignore, "ignore_returns": identity.ignore(3, loss=1.0),
                 "shared": identity.shared("data/x.pt"), "shared_bytes": identity.shared(b"data"),
                 "path": identity.checkpoint_path(None), "loaded": identity.load_checkpoint(None, None)}
try:
    identity.save_checkpoint({"w": 1})
except RuntimeError as error:
    out["before"]["save"] = str(error)
import torch
out["before"]["device"] = str(identity.own_device())
out["before"]["dtensors_unloaded"] = identity.holds_dtensors({"w": torch.ones(1)})

# -- the rank bootstrap: rank 1 of 3, seed 7
seen = []
os.environ.update(RANK="1", WORLD_SIZE="3")
identity.enter("cuda", 7, lambda step=None, **metrics: seen.append([step, metrics]))  # cuda asked, none here
import taas
info = taas.get_worker_info()
out["info"] = [type(info).__name__, info.id, info.num_workers, info.seed, info.dataset]
taas.report(4, loss=0.25)
taas.report(loss=0.5)
out["seen"], out["in_rank"], out["device"] = seen, taas.in_rank(), str(identity.own_device())

# -- checkpoints: rank 1's saves are not kept; rank 0's are, the newest 2
from taas_magic.writes import checkpoints
checkpoints.use_run(folder, 2)
out["rank1_save"] = identity.save_checkpoint({"w": torch.ones(2)})
out["empty_path"], out["empty_load"] = identity.checkpoint_path(), identity.load_checkpoint()
os.environ["RANK"] = "0"
out["saved"] = [identity.save_checkpoint({"step": step, "w": torch.full((2,), float(step))}) for step in range(3)]
out["path"], out["listing"] = identity.checkpoint_path(), sorted(os.listdir(folder))
loaded = identity.load_checkpoint()
out["loaded"] = [loaded["step"], loaded["w"].tolist(), str(loaded["w"].device)]
out["loaded_meta"] = str(identity.load_checkpoint(map_location="meta")["w"].device)

# -- DTensors: a one-rank gloo group, a mesh on the CPU
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, Replicate, distribute_tensor
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
mesh = DeviceMesh("cpu", [0])
shard = distribute_tensor(torch.ones(4), mesh, [Replicate()])
model = torch.nn.Linear(2, 2)
plain = torch.nn.Linear(2, 2)
model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Replicate()]))
deep = shard
for _ in range(10):
    deep = {"down": deep}
out["dtensors"] = {"dict": identity.holds_dtensors({"opt": {"state": [1, shard]}}), "tuple": identity.holds_dtensors((0, shard)),
                   "module": identity.holds_dtensors(model), "in_dict_module": identity.holds_dtensors({"model": model}),
                   "plain": identity.holds_dtensors({"model": plain, "w": torch.ones(1), "n": [1, "a"]}),
                   "too_deep": identity.holds_dtensors(deep)}
out["sharded"] = identity.save_checkpoint({"w": shard})
out["sharded_is_folder"] = os.path.isdir(out["sharded"] or "")
out["sharded_path"] = identity.checkpoint_path()
dist.destroy_process_group()
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    """What the child saw, before and after it entered a rank."""
    where = tmp_path_factory.mktemp("identity")
    folder = where / "checkpoints"
    folder.mkdir(mode=0o700)
    env = {name: value for name, value in os.environ.items() if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    ran = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(where / "store")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=WAIT * 2)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    report = json.loads(ran.stdout.splitlines()[-1])
    report["folder"] = str(folder)
    return report


def test_outside_a_rank_the_defaults_hold(seen):
    before = seen["before"]
    assert before["in_rank"] is False and before["info"] is None and before["device"] == "cpu"
    assert before["report_ignored"] is True and before["ignore_returns"] is None
    assert before["path"] is None and before["loaded"] is None  # no run folder: no checkpoint to name or load


def test_saving_a_checkpoint_outside_a_rank_says_where_to_save_instead(seen):
    assert seen["before"]["save"] == "taas.save_checkpoint works inside a taas cell; in the notebook, use torch.save"


def test_outside_a_rank_a_shared_path_is_only_made_absolute(seen):
    assert seen["before"]["shared"] == os.path.join(ROOT, "data", "x.pt")  # the child ran in ROOT
    assert seen["before"]["shared_bytes"] == os.path.join(ROOT, "data")


def test_in_a_rank_the_worker_info_is_the_ranks_with_the_runs_seed_plus_its_rank(seen):
    assert seen["in_rank"] is True
    assert seen["info"] == ["WorkerInfo", 1, 3, 8, None]  # seed 7 + rank 1


def test_in_a_rank_taas_report_reaches_the_reporter_the_bootstrap_gave(seen):
    assert seen["seen"] == [[4, {"loss": 0.25}], [None, {"loss": 0.5}]]


def test_a_rank_asked_for_cuda_on_a_host_without_it_works_on_the_cpu(seen):
    assert seen["device"] == "cpu"


def test_only_rank_0s_checkpoint_is_saved_and_the_newest_two_are_kept(seen):
    folder = seen["folder"]
    assert seen["rank1_save"] is None and seen["empty_path"] is None and seen["empty_load"] is None
    assert seen["saved"] == [os.path.join(folder, f"checkpoint-00000{n}.pt") for n in (1, 2, 3)]
    assert seen["listing"] == [".gitignore", "checkpoint-000002.pt", "checkpoint-000003.pt"]  # git leaves the folder alone
    assert seen["path"] == os.path.join(folder, "checkpoint-000003.pt")


def test_the_newest_checkpoint_loads_on_the_ranks_device_unless_told_otherwise(seen):
    assert seen["loaded"] == [2, [2.0, 2.0], "cpu"]
    assert seen["loaded_meta"] == "meta"


def test_a_dtensor_is_found_in_dicts_lists_and_modules_but_not_in_plain_state_or_too_deep(seen):
    assert seen["before"]["dtensors_unloaded"] is False  # their module not even imported: nothing to look for
    assert seen["dtensors"] == {"dict": True, "tuple": True, "module": True, "in_dict_module": True, "plain": False,
                                "too_deep": False}


def test_a_state_holding_dtensors_is_saved_sharded_as_the_runs_next_checkpoint_folder(seen):
    assert seen["sharded"] == os.path.join(seen["folder"], "checkpoint-000004") and seen["sharded_is_folder"]
    assert seen["sharded_path"] == seen["sharded"]
