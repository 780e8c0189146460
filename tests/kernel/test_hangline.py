"""The hang line over a real kernel (autopsy/hangline.py): while a rank waits in one collective past ``--hang``,
the cell says where every rank is, at most once a minute, and stops nothing; a loop of collectives is no hang."""

import re

from tests.kernel_client import warm_up

LINE = re.compile(r"taas: (ranks disagree|no rank has moved) for \d+ s: .*")

SLOW_RANK_0 = """\
#pragma taas --device cpu --gpus 2 --hang 1
import time, torch, torch.distributed as dist
dist.init_process_group("gloo")
for step in range(3000):  # seconds of collectives back to back: no hang, however long each one waits
    dist.all_reduce(torch.ones(1))
if dist.get_rank() == 0:
    time.sleep(9)
dist.barrier()
print("both ranks past the barrier", flush=True)
"""


def test_a_rank_waiting_for_a_sleeping_one_is_said_once_and_nothing_is_stopped(kernel):
    warm_up(kernel)
    ran = kernel.execute(SLOW_RANK_0)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    assert "both ranks past the barrier" in ran.stream("stdout")
    said = [m.group(0) for m in LINE.finditer(ran.stream())]
    assert len(said) == 1, ran.stream()  # the loop of all_reduces said nothing; the barrier once, not again
    assert re.fullmatch(r"taas: ranks disagree for \d+ s: rank 0 is at line 7 in time\.sleep; "
                        r"rank 1 waits in barrier \(line 8\)", said[0]), said


DISAGREE = """\
#pragma taas --device cpu --gpus 2 --hang 1 --timeout 9
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.zeros(1)
if dist.get_rank() == 0:
    dist.recv(t, src=1)
else:
    dist.barrier()
"""


def test_ranks_waiting_in_different_collectives_are_said_to_disagree_before_the_timeout(kernel):
    warm_up(kernel)
    ran = kernel.execute(DISAGREE)
    assert ran.error["ename"] == "RunTimeout", ran.stream()
    said = [m.group(0) for m in LINE.finditer(ran.stream())]
    assert len(said) == 1, ran.stream()
    assert re.fullmatch(r"taas: ranks disagree for \d+ s: rank 0 waits in recv \(line 6\); "
                        r"rank 1 waits in barrier \(line 8\)", said[0]), said
    assert "where the running ranks were: rank 0 waits in recv (line 6); rank 1 waits in barrier (line 8)" in ran.error_text()
