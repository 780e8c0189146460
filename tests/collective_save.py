"""A 2-rank FSDP2 ``dcp.save`` for the cluster tests (tests/ray/test_away.py, tests/slurm/test_slurm_away.py),
and the checks that it landed whole in the notebook's repository; and a resume there (writes/unseen.py).

The cell prints, for each rank, whether its host sees the repository's path (``REPO``, set in the
notebook), saves with DCP into ``ckpt/step3``, writes one stray file per rank (only rank 0's may
land), and binds rank 0's full tensors, against which the notebook then reads the checkpoint back
(``dcp_to_torch_save``: every part and the ``.metadata``, in the kernel's own process).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable

from tests.kernel_client import Execution, Kernel

# A small MLP sharded with FSDP2 over the 2 ranks' CPU mesh, and its optimizer: what a collective save saves
# (here, and in tests/kernel/test_checkpoints_whole.py and test_checkpoints_frameworks.py).
FSDP_MODEL = """\
import os, torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
mesh = init_device_mesh("cpu", (2,))
for layer in (model[0], model[2]):
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
"""
TRAIN_3_STEPS = """\
for step in range(3):
    optimizer.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
"""

SAVE = "#pragma taas --gpus 2 OPTIONS--output all\n" + FSDP_MODEL + """\
print("sees", rank, os.path.isdir(REPO), os.environ.get("SLURMD_NODENAME", ""), flush=True)
""" + TRAIN_3_STEPS + """\
dcp.save({"model": model.state_dict()}, checkpoint_id="ckpt/step3")
with open(f"stray-{rank}.txt", "w") as f:
    f.write("stray")
full = {k: v.full_tensor() for k, v in model.state_dict().items()}
dist.destroy_process_group()
del model, optimizer, mesh
"""

LOAD = """\
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save("ckpt/step3", "whole.pt")
whole = torch.load("whole.pt")["model"]
assert sorted(whole) == sorted(full), (sorted(whole), sorted(full))
assert all(torch.equal(whole[k], full[k]) for k in full)
print("same", len(full))
"""

LANDED = re.compile(r"taas: (\d+) file\(s\), [\d.]+ (?:bytes|kB|MB), written by rank\(s\) ([\d, ]+) on hosts that do not see the "
                    r"repository, sent to it")


def use_repository(kernel: Kernel, repo: Path) -> None:
    """The notebook's repository and working folder are ``repo`` (a folder with ``.git``)."""
    (repo / ".git").mkdir(parents=True, exist_ok=True)
    ran = kernel.execute(f"%taas config repo {repo}\nimport os\nos.chdir({str(repo)!r})\nREPO = {str(repo)!r}")
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()


def save(kernel: Kernel, options: str = "") -> tuple[Execution, dict[int, bool]]:
    """The save, run; whether each rank's host saw the repository's path."""
    ran = kernel.execute(SAVE.replace("OPTIONS", options), timeout=300)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    seen = {int(rank): sees == "True" for rank, sees in re.findall(r"\[rank (\d)\] sees \d (True|False)", ran.stream())}
    assert sorted(seen) == [0, 1], ran.stream()
    return ran, seen


def assert_whole(kernel: Kernel, repo: Path, ran: Execution, away: set[int]) -> None:
    """The checkpoint is whole in ``repo`` and reads back as rank 0's tensors; rank 0's stray file landed, rank
    1's did not; the ranks in ``away`` (on hosts that do not see the repository) sent their files, no other did."""
    stderr = ran.stream("stderr")
    assert sorted(os.listdir(repo / "ckpt" / "step3")) == [".metadata", "__0_0.distcp", "__1_0.distcp"], stderr
    assert "incomplete" not in stderr and "did not reach" not in stderr, stderr
    assert (repo / "stray-0.txt").read_text() == "stray" and not (repo / "stray-1.txt").exists()
    landed = LANDED.search(stderr)
    if away:
        assert landed is not None, stderr
        assert {int(rank) for rank in landed.group(2).split(", ")} == away, stderr
        # rank 0: its part, the .metadata and its stray file; rank 1: its part
        assert int(landed.group(1)) == (3 if 0 in away else 0) + (1 if 1 in away else 0), stderr
    else:
        assert landed is None, stderr
    check = kernel.execute(LOAD)
    assert check.reply["status"] == "ok", check.error_text() + check.stream()
    assert "same 4" in check.stream("stdout")


RESUME_SAVE = """\
#pragma taas --gpus 2 OPTIONS
import torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 0:
    torch.save({"step": 3}, "snapshot.pt")
dist.barrier()
"""
RESUME_LOAD = """\
#pragma taas --gpus 2 OPTIONS --timeout 90
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
step = torch.load("snapshot.pt")["step"] if os.path.exists("snapshot.pt") else 0  # the DDP tutorial's resume
dist.barrier()
print("resumed at", step)
"""


def assert_resume_fails_where_the_repository_is_not(kernel: Kernel, options: str, away: int,
                                                    placed: Callable[[], None] = lambda: None) -> None:
    """Rank 0, which sees the repository, saves in one cell; the next cell resumes: rank ``away``, on a host that
    does not see it, finds the file's name (the same branch as rank 0's) and fails reading it, with one line that
    says why, at once: no hang line, no timeout. ``placed()`` waits until the ranks will be placed as before."""
    saved = kernel.execute(RESUME_SAVE.replace("OPTIONS", options), timeout=300)
    assert saved.reply["status"] == "ok", saved.error_text() + saved.stream()
    placed()  # fresh ranks on Ray: placed as the first cell's were
    resumed = kernel.execute(RESUME_LOAD.replace("OPTIONS", options), timeout=300)
    error = resumed.error_text()
    assert resumed.error is not None and resumed.error["ename"] == "RankFailed", error + resumed.stream()
    assert f"rank {away}" in error and "UnseenFileError: snapshot.pt cannot be read here: " in error, error
    assert "this host does not see the notebook's repository" in error, error
    assert "ranks disagree" not in resumed.stream() and "resumed at" not in resumed.stream(), resumed.stream()
