"""``%taas export`` in a real kernel: a notebook defines a model class, a data function and a value, trains in a
2-rank taas cell with a fixed seed where every rank saves unguarded; the exported job, run by torchrun and by
``python`` where IPython, ipykernel and jupyter_client cannot be imported, writes bit-identical weights, only rank
0's file lands, and ``taas.load_job`` brings rank 0's names back. A name that cannot go stops the export."""

import os
import subprocess
import sys

import pytest
import torch

from tests.collective_save import FSDP_MODEL, TRAIN_3_STEPS
from tests.kernel_client import Kernel

DEFINITIONS = [
    "import torch\nclass Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.fc = torch.nn.Linear(8, 1)\n\n    def forward(self, x):\n        return self.fc(torch.tanh(x))\n",
    "def make_data(n, seed):\n    generator = torch.Generator().manual_seed(seed)\n"
    "    x = torch.randn(n, 8, generator=generator)\n    return x, x.sum(1, keepdim=True) * scale\n",
    "scale = 0.5\nlr = 0.05",
]
TRAIN = """#pragma taas --gpus 2 --device cpu
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=lr)
x, y = make_data(64, seed=dist.get_rank())
for step in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
torch.save(model.module.state_dict(), "weights.pt")  # every rank: only rank 0's lands
torch.save({"rank": dist.get_rank()}, "who.pt")
print("trained", float(loss))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The notebook trained once, its weights kept aside, and the cell exported as job/train.py."""
    folder = tmp_path_factory.mktemp("export")
    kernel = Kernel(cwd=str(folder))
    try:
        yield kernel, folder, train_and_export(kernel, folder)
    finally:
        kernel.shutdown()


def train_and_export(kernel: Kernel, folder) -> str:
    """The notebook's cells run in ``kernel`` (whose working directory is ``folder``): only rank 0's files landed,
    its weights set aside as notebook-weights.pt; then the cell exported as job/train.py. What the export said."""
    for cell in DEFINITIONS:
        ok(kernel, cell)
    trained = ok(kernel, TRAIN)
    assert "trained" in trained.stream("stdout")
    os.replace(folder / "weights.pt", folder / "notebook-weights.pt")
    assert torch.load(folder / "who.pt")["rank"] == 0
    os.remove(folder / "who.pt")
    return ok(kernel, "%taas export job/train.py").stream("stdout")


def ok(kernel: Kernel, code: str):
    ran = kernel.execute(code)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    return ran


def without_jupyter(folder) -> dict[str, str]:
    """An environment where importing IPython, ipykernel or jupyter_client fails."""
    blocked = folder / "no-jupyter"
    for name in ("IPython", "ipykernel", "jupyter_client"):
        (blocked / name).mkdir(parents=True, exist_ok=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is not here: a job runs without it')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), os.environ.get("PYTHONPATH", "")])}


def same_weights(first, second) -> bool:
    a, b = torch.load(first), torch.load(second)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_export_writes_the_job_and_says_what_went(exported):
    _, folder, said = exported
    assert "In[5] exported as train.py (2 rank(s) on cpu" in said and "train.sbatch and train_ray.py" in said
    # loss: the cell reads it after its loop, which may not run (cell/freenames.py): the closure a run ships too
    assert "2 definition(s) by source, 3 value(s)" in said, said
    script = (folder / "job" / "train.py").read_text()
    assert "class Net(torch.nn.Module):" in script and "def make_data(n, seed):" in script
    assert "loss, lr, scale = _taas.values('loss', 'lr', 'scale')" in script
    assert oct((folder / "job" / "train.taas").stat().st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("how", ["torchrun", "python"])
def test_the_job_trains_bit_identical_weights_without_jupyter_and_only_rank_0s_file_lands(exported, how):
    _, folder, _ = exported
    command = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "job/train.py"]
               if how == "torchrun" else [sys.executable, "job/train.py"])
    ran = subprocess.run(command, cwd=folder, env=without_jupyter(folder), capture_output=True, text=True, timeout=240)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "trained" in ran.stdout
    assert same_weights(folder / "weights.pt", folder / "notebook-weights.pt")
    assert torch.load(folder / "who.pt")["rank"] == 0
    os.remove(folder / "weights.pt")
    os.remove(folder / "who.pt")


def test_load_job_binds_rank_0s_names_in_the_notebook(exported):
    kernel, folder, _ = exported
    subprocess.run([sys.executable, "job/train.py"], cwd=folder, check=True, capture_output=True, timeout=240)
    shown = ok(kernel, "import taas\nnames = taas.load_job('job/train.py')\n"
                       "print(sorted(names), type(model).__name__, model.fc.weight.shape)").stream("stdout")
    assert "'model', 'opt'" in shown and "Net torch.Size([1, 8])" in shown


@pytest.mark.parametrize("made, read, said", [
    ("handle = open('notes.txt', 'w')", "handle.name", "handle (TextIOWrapper) cannot go with the job"),
    ("import socket\nlink = socket.socket()", "link.family", "link (socket) cannot go with the job"),
    ("numbers = (i for i in range(3))\nnext_one = lambda: next(numbers)", "next_one()",
     "numbers, which next_one reads, (a generator) cannot go with the job"),
])
def test_a_name_that_cannot_go_stops_the_export_in_one_line_and_writes_nothing(exported, made, read, said):
    kernel, folder, _ = exported
    ok(kernel, made)
    kernel.execute(f"#pragma taas --gpus 2 --device cpu\nprint({read})\n")  # run or not, the last taas cell
    failed = kernel.execute("%taas export other.py")
    assert failed.reply["status"] == "error" and failed.reply["ename"] == "UsageError"  # one line, no traceback
    assert f"taas: {said}" in failed.stream("stderr")
    assert not (folder / "other.py").exists() and not (folder / "other.sbatch").exists()


def test_a_named_cell_is_exported_and_a_cell_that_is_not_taas_is_refused(exported):
    kernel, folder, _ = exported
    assert "In[5] exported as again.py" in ok(kernel, "%taas export job/again.py In[5]").stream("stdout")
    refused = kernel.execute("%taas export job/again.py In[2]")
    assert "taas: In[2] is not a taas cell of this session" in refused.stream("stderr")


def test_a_collective_checkpoint_of_the_job_lands_whole_and_a_stray_write_once(tmp_path):
    """FSDP2 over the job's 2 CPU ranks, saved with DCP: every rank writes its part in place (as in a cell),
    while an unguarded torch.save lands once, rank 0's."""
    kernel = Kernel(cwd=str(tmp_path))
    try:
        ran = kernel.execute("#pragma taas --gpus 2 --device cpu --restarts 1\n" + FSDP_MODEL + TRAIN_3_STEPS
                             + "dcp.save({'model': model.state_dict()}, checkpoint_id='ckpt/step3')\n"
                             + "torch.save({'rank': rank}, 'stray.pt')\n")
        assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
        ok(kernel, "%taas export job/fsdp.py")
    finally:
        kernel.shutdown()
    for made in ("ckpt", "stray.pt"):
        subprocess.run(["rm", "-rf", str(tmp_path / made)], check=True)
    assert "--restarts 1" not in (tmp_path / "job" / "fsdp.sbatch").read_text()
    assert "for attempt in $(seq 0 1); do" in (tmp_path / "job" / "fsdp.sbatch").read_text()
    done = subprocess.run([sys.executable, "job/fsdp.py"], cwd=tmp_path, env=without_jupyter(tmp_path),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    parts = sorted(path.name for path in (tmp_path / "ckpt" / "step3").iterdir())
    assert ".metadata" in parts and len([p for p in parts if p.endswith(".distcp")]) == 2, parts
    assert torch.load(tmp_path / "stray.pt")["rank"] == 0


def test_a_registered_loader_feeds_each_rank_its_share_of_every_pass_in_the_job(tmp_path):
    """The data workers' split, in the job: 16 batches a pass, 8 to each of 2 ranks, every pass reshuffled."""
    kernel = Kernel(cwd=str(tmp_path))
    try:
        ok(kernel, "import taas, torch\nfrom torch.utils.data import DataLoader, TensorDataset\n"
                   "loader = taas.register(DataLoader(TensorDataset(torch.arange(512.0)), batch_size=32, shuffle=True))")
        ok(kernel, "#pragma taas --gpus 2 --device cpu --cpus 2\nimport os\nseen = []\nfor epoch in range(2):\n"
                   "    seen.append(sorted(int(x) for (batch,) in loader for x in batch))\n"
                   "print('rank', os.environ['RANK'], 'len', len(loader), 'took', len(seen[0]), len(seen[1]))\n")
        said = ok(kernel, "%taas export job/feed.py").stream("stdout")
    finally:
        kernel.shutdown()
    assert "loader = _taas.feed(loader, cpus=2, units=None, seed=" in (tmp_path / "job" / "feed.py").read_text(), said
    done = subprocess.run([sys.executable, "job/feed.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0 len 8 took 256 256" in done.stdout
    rank_1 = next((tmp_path / "job" / "feed.taas" / "logs").glob("*/attempt_0/1/stdout.log"))  # torch's layout
    assert "rank 1 len 8 took 256 256" in rank_1.read_text()


def test_shared_folders_are_written_in_place_by_every_rank_of_the_job(tmp_path):
    """--shared DIR in the pragma: in the job as in the cell, every rank's file there lands; elsewhere rank 0's only."""
    kernel = Kernel(cwd=str(tmp_path))
    try:
        cell = ("#pragma taas --gpus 2 --device cpu --shared parts\nimport os\nrank = os.environ['RANK']\n"
                "os.makedirs('parts', exist_ok=True)\nopen(f'parts/rank{rank}.txt', 'w').write(rank)\n"
                "open('stray.txt', 'w').write(rank)\n")
        ran = kernel.execute(cell)
        assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
        ok(kernel, "%taas export job/parts.py")
    finally:
        kernel.shutdown()
    subprocess.run(["rm", "-rf", str(tmp_path / "parts"), str(tmp_path / "stray.txt")], check=True)
    done = subprocess.run([sys.executable, "job/parts.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(path.name for path in (tmp_path / "parts").iterdir()) == ["rank0.txt", "rank1.txt"]
    assert (tmp_path / "stray.txt").read_text() == "0"


def test_a_notebook_class_a_value_holds_goes_with_the_job_by_its_source(tmp_path):
    """A registered loader over a Dataset class of the notebook: the value's pickle names __main__.Squares, so the
    class goes by its source, defined before the values load."""
    kernel = Kernel(cwd=str(tmp_path))
    try:
        ok(kernel, "import torch\nclass Squares(torch.utils.data.Dataset):\n    def __len__(self):\n        return 8\n"
                   "    def __getitem__(self, i):\n        return torch.tensor(float(i * i))\n")
        ok(kernel, "loader = torch.utils.data.DataLoader(Squares(), batch_size=4)")
        ok(kernel, "#pragma taas --gpus 2 --device cpu\nprint('sum', float(sum(b.sum() for b in loader)))\n")
        ok(kernel, "%taas export job/squares.py")
    finally:
        kernel.shutdown()
    script = (tmp_path / "job" / "squares.py").read_text()
    assert "class Squares(torch.utils.data.Dataset):" in script
    assert script.index("class Squares") < script.index("_taas.values(")
    done = subprocess.run([sys.executable, "job/squares.py"], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sum 140.0" in done.stdout
