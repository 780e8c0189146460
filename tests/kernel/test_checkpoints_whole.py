"""Every rank's checkpoint lands whole: collective saves reach the repository, in both isolation modes.

Each test runs a real 2-rank CPU cell (gloo) in a real kernel, with a scratch repository, and
loads what landed: DCP's ``dcp.load`` on the ranks in the next cell, ``dcp_to_torch_save`` in the
notebook. The stray writes of the same run stay diverted and reported, an incomplete checkpoint is
named in the cell, and rank 0's rotation of old checkpoints works.
"""

import os

import pytest

from tests.collective_save import FSDP_MODEL, TRAIN_3_STEPS
from tests.kernel.test_write_rule import HEADERS

FSDP_SETUP = "\n" + FSDP_MODEL + TRAIN_3_STEPS


def _ok(ran) -> None:
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()


def test_fsdp2_dcp_save_lands_whole_and_loads_on_the_ranks_and_in_the_notebook(kernel, repo, mode):
    ran = kernel.execute(
        "#pragma taas --device cpu --gpus 2\n" + FSDP_SETUP
        + "dcp.save({'model': model.state_dict()}, checkpoint_id='ckpt/step3')\n"
        "with open(f'stray-{rank}.txt', 'w') as f:\n    f.write('stray')\n"
        "full = {k: v.full_tensor() for k, v in model.state_dict().items()}\n"
        "dist.destroy_process_group()\n"
    )
    _ok(ran)
    assert HEADERS[mode] in ran.stream("stdout")
    assert sorted(os.listdir(repo / "ckpt" / "step3")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # the stray write of rank 1 in the same run: diverted and reported, as before
    assert (repo / "stray-0.txt").exists() and not (repo / "stray-1.txt").exists()
    report = [line for line in ran.stream("stderr").splitlines() if "tried to change" in line]
    assert len(report) == 1 and report[0].startswith("taas: rank 1 tried to change 1 path(s)"), ran.stream("stderr")
    assert "stray-1.txt" in report[0]
    assert "incomplete" not in ran.stream("stderr")

    loaded = kernel.execute(
        "#pragma taas --device cpu --gpus 2\n" + FSDP_SETUP.replace("for step in range(3)", "for step in range(0)")
        + "state = {'model': model.state_dict()}\n"
        "dcp.load(state, checkpoint_id='ckpt/step3')\n"
        "model.load_state_dict(state['model'])\n"
        "reloaded = {k: v.full_tensor() for k, v in model.state_dict().items()}\n"
        "dist.destroy_process_group()\n"
    )
    _ok(loaded)
    check = kernel.execute(
        "import torch\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "dcp_to_torch_save('ckpt/step3', 'whole.pt')\n"
        "whole = torch.load('whole.pt')['model']\n"
        "assert sorted(whole) == sorted(full) == sorted(reloaded), (sorted(whole), sorted(full))\n"
        "assert all(torch.equal(whole[k], full[k]) and torch.equal(reloaded[k], full[k]) for k in full)\n"
        "print('same', len(full))"
    )
    _ok(check)
    assert "same 4" in check.stream("stdout")


def test_a_ddp_model_saved_with_dcp_loads(kernel, repo, mode):
    ran = kernel.execute(
        "#pragma taas --device cpu --gpus 2\n"
        "import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp\n"
        "dist.init_process_group('gloo')\n"
        "torch.manual_seed(0)\n"
        "ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))\n"
        "state = {'model': ddp.module.state_dict(), 'extra': {'note': 'hello', 'step': 7}}\n"
        "dcp.save(state, checkpoint_id='ckpt/ddp')\n"
        "dist.destroy_process_group()\n"
    )
    _ok(ran)
    names = sorted(os.listdir(repo / "ckpt" / "ddp"))
    assert "__1_0.distcp" in names and ".metadata" in names, names
    check = kernel.execute(
        "import torch\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "dcp_to_torch_save('ckpt/ddp', 'ddp.pt')\n"
        "back = torch.load('ddp.pt', weights_only=False)\n"
        "torch.manual_seed(0)\n"
        "reference = torch.nn.Linear(64, 64).state_dict()\n"
        "assert all(torch.equal(back['model'][k], reference[k]) for k in reference)\n"
        "assert back['extra'] == {'note': 'hello', 'step': 7}, back['extra']\n"
        "print('ddp ok')"
    )
    _ok(check)
    assert "ddp ok" in check.stream("stdout")


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_async_save_lands_whole_with_either_executor(kernel, repo, mode, executor):
    kind = "THREAD" if executor == "thread" else "PROCESS"
    ran = kernel.execute(
        "#pragma taas --device cpu --gpus 2\n" + FSDP_SETUP
        + "from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType\n"
        # before the save: a collective of the cell on the group the save's thread uses would race it
        "full = {k: v.full_tensor() for k, v in model.state_dict().items()}\n"
        f"future = dcp.async_save({{'model': model.state_dict()}}, checkpoint_id='ckpt/async',"
        f" async_checkpointer_type=AsyncCheckpointerType.{kind})\n"
        "del future\n"  # the cell ends without waiting: taas waits for the save before the rank ends
    )
    _ok(ran)
    assert sorted(os.listdir(repo / "ckpt" / "async")) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert "incomplete" not in ran.stream("stderr")
    check = kernel.execute(
        "import torch\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "dcp_to_torch_save('ckpt/async', 'async.pt')\n"
        "whole = torch.load('async.pt')['model']\n"
        "assert all(torch.equal(whole[k], full[k]) for k in full)\n"
        "print('async ok')"
    )
    _ok(check)


def test_an_incomplete_checkpoint_is_named_with_its_files_and_ranks(kernel, repo, mode):
    ran = kernel.execute(
        "#pragma taas --device cpu --gpus 2\n" + FSDP_SETUP
        + "dcp.save({'model': model.state_dict()}, checkpoint_id='ckpt/torn')\n"
        "dist.barrier()\n"
        "if rank == 0:\n    os.remove('ckpt/torn/__1_0.distcp')\n"  # rank 1's part, gone after the save
        "dist.destroy_process_group()\n"
    )
    _ok(ran)
    lines = [line for line in ran.stream("stderr").splitlines() if "incomplete" in line]
    assert lines == ["taas: checkpoint ckpt/torn is incomplete: .metadata lists __1_0.distcp (rank 1), missing"], \
        ran.stream("stderr")


def test_a_rank_killed_mid_save_leaves_a_checkpoint_named_incomplete(kernel, repo, mode):
    ran = kernel.execute(
        "#pragma taas --device cpu --gpus 2 --timeout 20\n" + FSDP_SETUP
        + "from torch.distributed.checkpoint import FileSystemWriter\n"
        "write = FileSystemWriter.write_data\n"
        "def write_then_die(self, *args, **kwargs):\n"
        "    done = write(self, *args, **kwargs)\n"
        "    if rank == 1:\n"
        "        os.kill(os.getpid(), 9)\n"
        "    return done\n"
        "FileSystemWriter.write_data = write_then_die\n"
        "dcp.save({'model': model.state_dict()}, checkpoint_id='ckpt/killed')\n"
    )
    assert ran.reply["status"] == "error"
    lines = [line for line in ran.stream("stderr").splitlines() if "incomplete" in line]
    assert len(lines) == 1, ran.stream("stderr")
    assert lines[0].startswith("taas: checkpoint ckpt/killed is incomplete: no .metadata: the save did not finish"), lines
    assert "__1_0.distcp (rank 1)" in lines[0]


UNRECOGNISED = """
import os, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
os.makedirs("parts", exist_ok=True)
with open(f"parts/part-{rank}.bin", "wb") as f:   # a saver taas does not know: one file per rank
    f.write(bytes([rank]) * 16)
with open(f"stray-{rank}.txt", "w") as f:
    f.write("stray")
dist.destroy_process_group()
"""


def test_an_unrecognised_saver_lands_whole_with_shared(kernel, repo, mode):
    ran = kernel.execute("#pragma taas --device cpu --gpus 2 --shared parts\n" + UNRECOGNISED)
    _ok(ran)
    assert "written in place by every rank: parts" in ran.stream("stdout")
    assert sorted(os.listdir(repo / "parts")) == ["part-0.bin", "part-1.bin"]
    assert (repo / "parts" / "part-1.bin").read_bytes() == bytes([1]) * 16
    assert not (repo / "stray-1.txt").exists()
    assert "rank 1 tried to change 1 path(s)" in ran.stream("stderr")


def test_taas_shared_from_the_cell_does_the_same(kernel, repo, mode):
    ran = kernel.execute("#pragma taas --device cpu --gpus 2\nimport taas\ntaas.shared('parts')\n" + UNRECOGNISED)
    _ok(ran)
    assert sorted(os.listdir(repo / "parts")) == ["part-0.bin", "part-1.bin"]
    assert not (repo / "stray-1.txt").exists()


def test_without_shared_the_unrecognised_saver_keeps_rank_0s_file_only(kernel, repo, mode):
    ran = kernel.execute("#pragma taas --device cpu --gpus 2\n" + UNRECOGNISED)
    _ok(ran)
    assert sorted(os.listdir(repo / "parts")) == ["part-0.bin"]


def test_shared_outside_the_repository_is_one_line_and_launches_nothing(kernel, repo, mode):
    ran = kernel.execute("#pragma taas --device cpu --gpus 2 --shared /tmp\nprint('ran')")
    assert ran.reply["status"] == "error"
    assert "--shared /tmp: /tmp is outside the repository" in ran.error_text(), ran.error_text()
    assert "ran" not in ran.stream("stdout")


RESUMING = """
import os, taas, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint import FileSystemWriter
dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
state = {"model": model.state_dict(), "step": 0}
resumed = taas.load_checkpoint(into=state) is not None
model.load_state_dict(state["model"])
start = state["step"]
print(f"attempt {attempt} resumed at step {start}", flush=True)
write = FileSystemWriter.write_data
def write_then_die(self, *args, **kwargs):
    done = write(self, *args, **kwargs)
    if rank == 1 and attempt == 0 and state["step"] == 3:
        os.kill(os.getpid(), 9)   # rank 1 dies mid-save: its part is written, .metadata never is
    return done
FileSystemWriter.write_data = write_then_die
for step in range(start, 4):
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    state = {"model": model.state_dict(), "step": step + 1}
    path = taas.save_checkpoint(state)
final = {k: v.full_tensor() for k, v in model.state_dict().items()}
dist.destroy_process_group()
"""


def test_restarts_resume_from_the_newest_whole_sharded_checkpoint(kernel, repo, mode):
    ran = kernel.execute("#pragma taas --device cpu --gpus 2 --restarts 1\n" + RESUMING)
    _ok(ran)
    out = ran.stream("stdout")
    assert "attempt 0 resumed at step 0" in out and "attempt 1 resumed at step 2" in out, out
    assert "incomplete" not in ran.stream("stderr")  # the torn step was removed by the next save
    check = kernel.execute(
        "import taas, torch\n"
        "whole = taas.load_checkpoint()\n"
        "assert whole['step'] == 4, whole['step']\n"
        "assert all(torch.equal(whole['model'][k], final[k]) for k in final)\n"
        "torch.manual_seed(0)\n"
        "reference = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).state_dict()\n"
        "for _ in range(4):\n    reference = {k: v + 1.0 for k, v in reference.items()}\n"
        "assert all(torch.equal(final[k], reference[k]) for k in reference)\n"  # four steps, none twice
        "print(sorted(name for name in os.listdir(os.path.dirname(taas.checkpoint_path())) if name[0] != '.'))"
    )
    _ok(check)
    # steps 1 and 2 whole, the torn save of step 3 (number 3) removed by the next save; the newest two kept
    assert "['checkpoint-000004', 'checkpoint-000005']" in check.stream("stdout"), check.stream("stdout")


def test_the_hugging_face_writer_consolidates_every_ranks_shard(kernel, repo, mode):
    """Every rank writes its shard under hf/sharded, then rank 0 consolidates them into hf/: with a shard
    left in rank 1's layer, the consolidated file would hold rank 0's rows only, silently."""
    ran = kernel.execute(
        "#pragma taas --device cpu --gpus 2\n" + FSDP_SETUP
        + "from torch.distributed.checkpoint import HuggingFaceStorageWriter\n"
        "writer = HuggingFaceStorageWriter(path='hf', save_distributed=True, enable_consolidation=True)\n"
        "dcp.save(model.state_dict(), storage_writer=writer)\n"
        "full = {k: v.full_tensor() for k, v in model.state_dict().items()}\n"
        "dist.destroy_process_group()\n"
    )
    _ok(ran)
    shards = sorted(os.listdir(repo / "hf" / "sharded"))
    assert len([name for name in shards if name.endswith(".safetensors")]) == 2, shards
    check = kernel.execute(
        "import glob, torch\n"
        "from safetensors.torch import load_file\n"
        "[whole_file] = glob.glob('hf/*.safetensors')\n"
        "whole = load_file(whole_file)\n"
        "assert sorted(whole) == sorted(full), (sorted(whole), sorted(full))\n"
        "assert all(torch.equal(whole[k], full[k]) for k in full)\n"
        "print('hf ok')"
    )
    _ok(check)
    assert "hf ok" in check.stream("stdout")
