"""Only rank 0 writes to the repository: byte-level snapshots before and after."""

import os
import shutil
import stat
from pathlib import Path

import pytest

# Every way of writing, as a function of the rank: run by every rank in the cell, and by
# the test for rank 0 alone on a copy, which gives the repository we must end up with.
OPERATIONS = '''
def write_everything(root, r, subprocesses=True):
    import os, pathlib, shutil, subprocess
    import numpy, torch
    j = lambda name: os.path.join(root, name)
    with open(j(f"new_{r}.txt"), "w") as f: f.write(f"made by {r}")
    with open(j("shared.txt"), "w") as f: f.write(f"overwritten by {r}")
    with open(j("append.txt"), "a") as f: f.write(f"appended by {r}\\n")
    with open(j(f"trunc_{r}.txt"), "r+") as f: f.truncate(3)
    os.remove(j(f"del_{r}.txt"))
    os.rename(j(f"mv_{r}.txt"), j(f"moved_{r}.txt"))
    os.replace(j(f"rep_{r}.txt"), j(f"replaced_{r}.txt"))
    os.mkdir(j(f"dir_{r}"))
    os.chmod(j(f"mode_{r}.txt"), 0o600)
    torch.save({"rank": torch.tensor([r])}, j(f"t_{r}.pt"))
    numpy.save(j(f"n_{r}.npy"), numpy.arange(4) + r)
    pathlib.Path(j(f"p_{r}.txt")).write_text(f"pathlib {r}")
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    TorchCheckpointIO().save_checkpoint({"rank": torch.tensor([r])}, j(f"lightning_{r}.pt"))
    shutil.copy(j("src.txt"), j(f"copy_{r}.txt"))
    shutil.move(j(f"smv_{r}.txt"), j(f"smoved_{r}.txt"))
    shutil.rmtree(j(f"tree_{r}"))
    if subprocesses:
        subprocess.run(["touch", j(f"touched_{r}")], check=True)
        subprocess.run(["cp", j("src.txt"), j(f"cp_{r}.txt")], check=True)
    with open(j(f"new_{r}.txt")) as f:  # the rank reads back what it wrote
        assert f.read() == f"made by {r}"
    assert not os.path.exists(j(f"del_{r}.txt"))
'''


def _seed(root: Path) -> None:
    (root / ".git").mkdir()
    (root / "shared.txt").write_text("original")
    (root / "append.txt").write_text("first line\n")
    (root / "src.txt").write_text("source")
    for r in (0, 1):
        for name in ("trunc", "del", "mv", "rep", "mode", "smv"):
            (root / f"{name}_{r}.txt").write_text(f"{name} {r} original")
        (root / f"tree_{r}").mkdir()
        (root / f"tree_{r}" / "leaf.txt").write_text("leaf")


def snapshot(root: Path) -> dict:
    """Every path under root: its kind, mode bits and bytes (torch zips: their tensors)."""
    import torch

    state = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        relative = str(path.relative_to(root))
        if path.is_dir():
            state[relative] = ("dir", stat.S_IMODE(info.st_mode))
        elif path.suffix == ".pt":
            state[relative] = ("pt", stat.S_IMODE(info.st_mode), {k: v.tolist() for k, v in torch.load(path).items()})
        else:
            state[relative] = ("file", stat.S_IMODE(info.st_mode), path.read_bytes())
    return state


HEADERS = {
    "overlay": "other ranks' writes there are diverted (overlay)",
    "python": "other ranks' writes there are diverted by Python (chosen with %taas config isolation python)",
}


@pytest.fixture()
def scratch_repo(kernel, tmp_path, mode):
    repo = tmp_path / "repo"
    repo.mkdir()
    _seed(repo)
    ran = kernel.execute(f"%taas config repo {repo}")
    assert ran.reply["status"] == "ok", ran.stream()
    yield repo
    kernel.execute(f"%taas config repo {os.getcwd()}")


def test_repository_holds_exactly_rank_0s_changes(kernel, scratch_repo, tmp_path, mode):
    subprocesses = mode == "overlay"  # the Python fallback documents that it cannot see them
    expected_root = tmp_path / "expected"
    shutil.copytree(scratch_repo, expected_root)
    namespace: dict = {}
    exec(OPERATIONS, namespace)  # noqa: S102 - the same operations, for rank 0 only
    namespace["write_everything"](str(expected_root), 0, subprocesses)

    kernel.execute(OPERATIONS)
    ran = kernel.execute(
        f"#pragma taas --device cpu --gpus 2 --output all\nimport os\n"
        f"write_everything({str(scratch_repo)!r}, int(os.environ['RANK']), {subprocesses})\n"
        "print('wrote', os.environ['RANK'])"
    )
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    assert "[rank 0] wrote 0" in ran.stream("stdout") and "[rank 1] wrote 1" in ran.stream("stdout")
    assert HEADERS[mode] in ran.stream("stdout")
    assert snapshot(scratch_repo) == snapshot(expected_root)
    report = [line for line in ran.stream("stderr").splitlines() if "tried to change" in line]
    assert len(report) == 1 and report[0].startswith("taas: rank 1 tried to change")
    assert "rank 0" not in ran.stream("stderr")


def test_unguarded_save_by_every_rank_holds_rank_0s_state(kernel, scratch_repo):
    ran = kernel.execute(
        f"#pragma taas --device cpu --gpus 2\nimport os, torch\nstate = {{'w': torch.full((3,), float(os.environ['RANK']))}}\n"
        f"torch.save(state, {str(scratch_repo / 'model.pt')!r})"
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    import torch

    assert torch.load(scratch_repo / "model.pt")["w"].tolist() == [0.0, 0.0, 0.0]
    assert "rank 1 tried to change 1 path(s)" in ran.stream("stderr") and "model.pt" in ran.stream("stderr")


def test_writes_outside_the_repository_are_untouched(kernel, scratch_repo, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    ran = kernel.execute(
        f"#pragma taas --device cpu --gpus 2\nimport os\nopen(os.path.join({str(outside)!r}, 'r' + os.environ['RANK']), 'w').write('x')"
    )
    assert ran.reply["status"] == "ok", ran.error_text()
    assert sorted(os.listdir(outside)) == ["r0", "r1"]
    assert "tried to change" not in ran.stream("stderr")


def test_scratch_layers_are_removed_after_the_cell(kernel, scratch_repo):
    import tempfile

    mine = f"taas-scratch-{kernel.pid}-"  # this kernel's: other kernels on the machine make their own meanwhile
    before = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith(mine)}
    kernel.execute(f"#pragma taas --device cpu --gpus 2\nopen({str(scratch_repo / 'x.txt')!r}, 'w').write('x')")
    after = {p for p in os.listdir(tempfile.gettempdir()) if p.startswith(mine)}
    assert after <= before


def test_shared_memory_and_sockets_work_in_an_isolated_rank(kernel, scratch_repo):
    # DataLoader workers hand tensors over through /dev/shm; the all-reduce crosses from
    # rank 1's namespaces to rank 0 over gloo's sockets.
    ran = kernel.execute(
        """#pragma taas --device cpu --gpus 2 --output all
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
dist.init_process_group("gloo")
loader = DataLoader(TensorDataset(torch.arange(32.0)), batch_size=8, num_workers=2)
total = torch.tensor([sum(batch[0].sum().item() for batch in loader)])
dist.all_reduce(total)
print("TOTAL", total.item())
dist.destroy_process_group()
"""
    )
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    assert ran.stream("stdout").count("TOTAL 992.0") == 2


def test_a_repository_the_overlay_refuses_falls_back_to_python_in_the_rank(kernel):
    # The probe passed, but overlayfs refuses /proc/sys as its lower layer.
    kernel.execute("%taas config repo /proc/sys")
    try:
        ran = kernel.execute("#pragma taas --device cpu --gpus 2 --output all\nimport os\nprint('entries', len(os.listdir('/proc/sys')) > 0)")
    finally:
        kernel.execute(f"%taas config repo {os.getcwd()}")
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    assert "rank 1 could not mount the overlay over /proc/sys" in ran.stream("stderr")
    assert ran.stream("stdout").count("entries True") == 2


def test_layers_of_a_killed_kernel_are_swept(kernel, tmp_path):
    import tempfile

    dead = 2**22 + 12345  # above pid_max's default range: no such process
    orphan = Path(tempfile.gettempdir()) / f"taas-scratch-{dead}-abcd"
    (orphan / "rank1" / "upper").mkdir(parents=True)
    (orphan / "rank1" / "upper" / "model.pt").write_bytes(b"diverted")
    ran = kernel.execute("#pragma taas --device cpu --gpus 2\nx_swept = 1")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert not orphan.exists()
