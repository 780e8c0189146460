"""Checks that run alike on Ray (tests/ray) and Slurm (tests/slurm): four ranks over two hosts, in a kernel
attached to the cluster, whose working folder is a repository both hosts see."""

import re

from tests.kernel_client import Kernel
from tests.view_cells import expected, gathered


def every_rank_sees_rank_0s_writes(kernel: Kernel) -> None:
    """writes/refresh.py: ranks 1-3 look every path up first, rank 0 changes them (tests/view_cells.py, seeded in
    the working folder), and after a barrier every rank on both hosts sees rank 0's changes and its own writes."""
    ran = kernel.execute(gathered("#pragma taas --gpus 4", 4), timeout=120)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    seen = kernel.execute("print(repr(seen))").stream("stdout")
    assert eval(seen) == [expected(rank) for rank in range(4)], seen  # noqa: S307 - the test's own repr


def the_hang_line_is_said_once_and_the_cell_completes(kernel: Kernel) -> None:
    """autopsy/hangline.py: ranks 1-3 wait in a barrier while rank 0 sleeps; the cell says so while it waits (the
    ranks' health through their channels, their stacks through each host's agent), then completes."""
    ran = kernel.execute("#pragma taas --gpus 4 --hang 1\nimport time, torch.distributed as dist\n"
                         "dist.init_process_group('gloo')\nif dist.get_rank() == 0:\n    time.sleep(8)\n"
                         "dist.barrier()\n", timeout=120)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    said = [line for line in ran.stream().splitlines() if line.startswith("taas: ranks disagree for ")]
    assert len(said) == 1, ran.stream()
    assert said[0].endswith(": rank 0 is at line 5 in time.sleep; ranks 1, 2, 3 wait in barrier (line 6)"), said


def a_failed_collective_costs_the_cell_not_the_kept_ranks(kernel: Kernel, keep: str, pids: dict[str, str]) -> None:
    """rank/abortable.py on a cluster: in kept ranks (``keep``, their ``pids`` by rank, each with ``mine = 10 * rank``
    and a default group), rank 1 raises while the others wait in all_reduce; the cell fails naming it, and the next
    kept cell runs in the same processes, with each rank's globals and a working group."""
    failed = kernel.execute(keep + "if dist.get_rank() == 1:\n    raise RuntimeError('rank 1 gave up')\n"
                            "mine += 1\ndist.all_reduce(torch.ones(1))\n")
    assert "raised RuntimeError: rank 1 gave up" in failed.error_text(), failed.error_text()
    assert "the ranks are kept, with their globals" in failed.error_text() + failed.stream()
    again = kernel.execute(keep + "t = torch.ones(1)\ndist.all_reduce(t)\nprint('again', os.getpid(), mine, t.item())\n")
    assert again.reply["status"] == "ok", again.error_text()
    for rank, pid in pids.items():
        kept = 10 * int(rank) + (int(rank) != 1)  # the others added 1 before they waited
        assert f"[rank {rank}] again {pid.split()[0]} {kept} 4.0" in again.stream(), again.stream()


def a_killed_rank_is_replaced_and_the_others_keep_their_state(kernel: Kernel, keep: str, pids: dict[str, str]) -> None:
    """kernel/supervision/replacement.py on a cluster: in kept ranks (``keep``, their ``pids`` by rank, each with
    ``mine`` and a default group), rank 3 (the second host's) is killed while the others wait in all_reduce; the
    cell fails naming it, and the next kept cell runs with a new rank 3 there, the others in their processes with
    their globals, and the group works across both hosts."""
    failed = kernel.execute(keep + "import signal\nif dist.get_rank() == 3:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                            "dist.all_reduce(torch.ones(1))\n")
    said = failed.error_text() + failed.stream()
    assert "rank 3 on " in said and "was killed by SIGKILL" in said, said
    assert "the next --keep cell starts a new rank 3 in its place" in said, said
    again = kernel.execute(keep + "import os, torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                           "print('again', os.getpid(), globals().get('mine'), t.item())\n")
    assert again.reply["status"] == "ok", again.error_text()
    assert "taas: rank 3 was killed by SIGKILL and was replaced by a new process" in again.stream(), again.stream()
    for rank in ("0", "1", "2"):
        assert re.search(rf"\[rank {rank}\] again {pids[rank].split()[0]} \d+ 4\.0", again.stream()), again.stream()
    replaced = re.search(r"\[rank 3\] again (\d+) None 4\.0", again.stream())
    assert replaced and replaced.group(1) != pids["3"].split()[0], again.stream()
