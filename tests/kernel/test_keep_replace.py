"""A kept rank that dies (SIGKILL, in a cell or between cells) in a real kernel: the others keep their state, the
next kept cell runs with a new process in its place and says what went with the dead one, ``%taas status`` shows
it, and ``%taas heal --from 0`` copies rank 0's names into the new rank, after which DDP trains on; rank 0's new
process hosts a new rendezvous store, which the others join; ten replacements leak nothing."""

import os
import re
import signal
import time

import psutil

from tests.kernel.test_keep import _footprint, assert_nothing_grew, k, keeper, ok, pids_of  # noqa: F401 - k and keeper: its fixtures

KEEP3 = "#pragma taas --gpus 3 --device cpu --keep --output all"
KEEP2 = "#pragma taas --gpus 2 --device cpu --keep --output all"


def mine_by_rank(text: str) -> dict[int, str]:
    """``[rank k] ... mine M`` lines -> {k: M}."""
    return {int(rank): mine for rank, mine in re.findall(r"\[rank (\d)\] .*mine (\S+)", text)}


def test_a_rank_killed_in_ddps_all_reduce_is_replaced_the_others_keep_their_state_and_heal_lets_ddp_train_on(k):
    first = ok(k, f"""{KEEP3}
import os, signal, torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                                                      torch.nn.Linear(8, 2)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
def train(steps):
    for _ in range(steps):
        opt.zero_grad(); model(torch.randn(16, 4)).sum().backward(); opt.step()
train(3)
mine = 10 * dist.get_rank()
print("pid", os.getpid())
""")
    pids = pids_of(first.stream())
    failed = k.execute(f"""{KEEP3}
if dist.get_rank() == 2:
    os.kill(os.getpid(), signal.SIGKILL)
train(2)  # ranks 0 and 1 wait in the backward's all-reduce
""")
    assert failed.reply["status"] == "error"
    said = failed.error_text() + failed.stream()
    assert "rank 2 on localhost was killed by SIGKILL" in said, said
    assert "the other ranks are kept, with their globals and their process group: the next --keep cell starts a " \
           "new rank 2 in its place" in said, said
    status = ok(k, "%taas status").stream()
    assert "rank 2 on localhost was killed by SIGKILL: the next --keep cell starts a new process in its place" in status

    again = ok(k, f"""{KEEP3}
import os, torch, torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
print("pid", os.getpid(), "total", t.item(), "mine", globals().get("mine"))
""")
    text = again.stream()
    assert "taas: rank 2 was killed by SIGKILL and was replaced by a new process: mine, model, opt, train and its " \
           "imports (dist, os, signal and torch) are gone there; the other ranks kept theirs (%taas heal --from 0 " \
           "copies rank 0's)" in text, text
    now = pids_of(text)
    assert (now[0], now[1]) == (pids[0], pids[1]) and now[2] != pids[2], (pids, now)
    assert text.count("total 3.0") == 3, text
    assert mine_by_rank(text) == {0: "0", 1: "10", 2: "None"}, text
    assert "was replaced by a new process" in ok(k, "%taas status").stream()

    healed = ok(k, "%taas heal --from 0").stream()
    assert "taas: heal: rank 2: copied " in healed and "model" in healed and "opt" in healed, healed
    assert "taas: heal: DDP's reducer rebuilt on every rank for model" in healed, healed
    trained = ok(k, f"""{KEEP3}
train(4)
weights = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(weights) for _ in range(3)]
dist.all_gather(gathered, weights)
print("replicas agree", all(torch.equal(gathered[0], each) for each in gathered), "steps", len(opt.state))
""").stream()
    assert trained.count("replicas agree True steps 4") == 3, trained


def test_a_rank_killed_between_cells_is_replaced_in_the_next_cell_and_heal_refuses_what_must_not_be_copied(k):
    first = ok(k, f"""{KEEP2}
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (2,))
pair = dist.new_group([0, 1])
sharded = fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
loader = DataLoader(list(range(8)), sampler=DistributedSampler(list(range(8))))
mine = 10 * dist.get_rank()
print("pid", os.getpid())
""")
    pids = pids_of(first.stream())
    os.kill(pids[1], signal.SIGKILL)
    time.sleep(0.5)
    assert "rank 1 on localhost was killed by SIGKILL" in ok(k, "%taas status").stream()
    again = ok(k, f"""{KEEP2}
import os, torch, torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
print("pid", os.getpid(), "total", t.item(), "mine", globals().get("mine"))
""")
    text = again.stream()
    assert "taas: rank 1 was killed by SIGKILL and was replaced by a new process: " in text, text
    assert pids_of(text)[0] == pids[0] and pids_of(text)[1] != pids[1], text
    assert text.count("total 2.0") == 2 and mine_by_rank(text) == {0: "0", 1: "None"}, text
    healed = ok(k, "%taas heal --from 0").stream()
    assert "not loader: its DistributedSampler is rank 0's (make it again on this rank)" in healed, healed
    assert "not sharded: it is sharded: rank 0's shard is not this rank's" in healed, healed
    assert "mine" in healed.split("copied ")[1], healed
    assert "not pair: a process group is made by every rank together" in healed, healed
    assert "not mesh: a DeviceMesh is made by every rank together" in healed, healed
    retired = k.execute(f"{KEEP2}\nif dist.get_rank() == 0:\n    dist.all_reduce(torch.ones(1), group=pair)\n")
    assert "make it again: the rank that replaced a dead one never made it" in retired.error_text(), retired.error_text()
    ok(k, f"{KEEP2}\npair = dist.new_group([0, 1])\ndist.all_reduce(torch.ones(1), group=pair)\n")


def test_rank_0_killed_in_a_cell_is_replaced_its_new_process_hosts_the_store_and_heal_from_1_fills_it(k):
    """Rank 0's process hosted the rendezvous store: its new one hosts a new one where it was, the survivors
    connect to it, and the default group and new groups work across them."""
    pids = pids_of(ok(k, f"""{KEEP3}
import os, signal, torch, torch.distributed as dist
dist.init_process_group('gloo')
mine = 10 * dist.get_rank()
print("pid", os.getpid())
""").stream())
    failed = k.execute(f"""{KEEP3}
if dist.get_rank() == 0:
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(torch.ones(1))
""")
    said = failed.error_text() + failed.stream()
    assert "rank 0 on localhost was killed by SIGKILL" in said and "starts a new rank 0 in its place" in said, said
    again = ok(k, f"""{KEEP3}
import os, torch, torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
pair = dist.new_group([0, 2])
u = torch.ones(1)
dist.all_reduce(u, group=pair)
print("pid", os.getpid(), "total", t.item(), u.item(), "mine", globals().get("mine"))
""").stream()
    assert "taas: rank 0 was killed by SIGKILL and was replaced by a new process: mine and its imports" in again, again
    assert "(%taas heal --from 1 copies rank 1's)" in again, again
    now = pids_of(again)
    assert now[0] != pids[0] and (now[1], now[2]) == (pids[1], pids[2]), (pids, now)
    assert again.count("total 3.0 2.0") == 2 and "[rank 1] pid" in again and " total 3.0 1.0 " in again, again  # (1: not in pair)
    assert mine_by_rank(again) == {0: "None", 1: "10", 2: "20"}, again
    assert "rank 0: copied " in ok(k, "%taas heal --from 1 mine").stream()
    assert "[rank 0] mine 10" in ok(k, f"{KEEP3}\nprint('mine', mine)\n").stream()


def test_ranks_without_a_process_group_get_a_new_rank_without_one_and_heal_says_it_needs_one(k):
    pids = pids_of(ok(k, f"{KEEP2}\nimport os\nmine = 1\nprint('pid', os.getpid())\n").stream())
    os.kill(pids[1], signal.SIGKILL)
    time.sleep(0.5)
    again = ok(k, f"{KEEP2}\nimport os\nprint('pid', os.getpid(), 'mine', globals().get('mine'))\n").stream()
    assert "taas: rank 1 was killed by SIGKILL and was replaced" in again and mine_by_rank(again) == {0: "1", 1: "None"}
    healed = ok(k, "%taas heal --from 0").stream()
    assert "taas: heal: the kept ranks have no default process group" in healed, healed


def test_ten_replaced_ranks_in_a_row_leak_no_files_threads_or_memory_in_the_kernel_or_rank_0(k):
    """Each replacement abandons rank 0's communicator and makes a new one with the new rank, and the kernel
    forgets the dead process's pipes and pidfd: after the first (what a first one creates once), ten leave every
    count where it was."""
    pids = pids_of(ok(k, f"""{KEEP2}
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
print("pid", os.getpid())
""").stream())
    cell = f"{KEEP2}\nimport os, torch, torch.distributed as dist\ndist.all_reduce(torch.ones(1))\nprint('pid', os.getpid())\n"

    def replace_rank_1() -> dict[str, tuple[int, int, int]]:
        os.kill(pids[1], signal.SIGKILL)
        psutil.Process(pids[1]).wait(10) if psutil.pid_exists(pids[1]) else None
        pids.update(pids_of(ok(k, cell).stream()))
        ok(k, cell)  # the last generation reaped meanwhile
        time.sleep(0.5)
        return {"kernel": _footprint(k.pid), "rank 0": _footprint(pids[0])}

    replace_rank_1()
    before = replace_rank_1()
    for _ in range(9):
        replace_rank_1()
    assert_nothing_grew(before, replace_rank_1(), "ten replaced ranks")
