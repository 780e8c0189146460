"""torch.distributed for the unit tests of what needs a process group (FSDP, DTensor, DCP, DDP): a gloo group of one
rank in the test process and its CPU mesh, over a TCPStore that binds its own free port (no port picked, then bound
later, which a test beside it could take meanwhile); and real ranks, forks of the test process in a group of
their own, each reporting what it saw, or fresh processes (what patches torch for good, or must not inherit the
test process's threads)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import socket
import subprocess
from typing import Callable, Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@contextlib.contextmanager
def one_rank_group() -> Iterator[DeviceMesh]:
    """A one-process gloo group and its CPU mesh, gone again afterwards (as in the notebook after a cell)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A loopback port free now, for ranks in other processes that must agree on one before any of them binds it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def forked_ranks(target: Callable[..., None], *args: object, world: int = 2) -> list:
    """What each of ``world`` real ranks reports: forks of this process (its imports; call it before this process
    makes a group), each running ``target(rank, port, *args, sends)`` and sending one report on ``sends``; all joined
    with exit 0, or killed."""
    context = multiprocessing.get_context("fork")
    port = free_port()
    pipes = [context.Pipe(duplex=False) for _ in range(world)]
    ranks = [context.Process(target=target, args=(rank, port, *args, pipes[rank][1])) for rank in range(world)]
    try:
        for rank in ranks:
            rank.start()
        reports = []
        for receives, _ in pipes:
            assert receives.poll(60), "a rank reported nothing"
            reports.append(receives.recv())
        for rank in ranks:
            rank.join(30)
        assert [rank.exitcode for rank in ranks] == [0] * world, reports
        return reports
    finally:
        for rank in ranks:
            if rank.is_alive():
                rank.kill()
                rank.join()
        for receives, sends in pipes:
            receives.close()
            sends.close()


def fresh_ranks(command: Callable[[int], list[str]], world: int = 2, timeout: float = 120,
                env: Callable[[int], dict] | None = None, cwd: str | None = None) -> list:
    """What each of ``world`` ranks, fresh processes running ``command(rank)``, printed last (one JSON line each);
    all exit 0, or the failure holds what they wrote on stderr; every one reaped."""
    ranks = [subprocess.Popen(command(rank), env=env(rank) if env else None, cwd=cwd, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(world)]
    try:
        said = [rank.communicate(timeout=timeout) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert [rank.returncode for rank in ranks] == [0] * world, [err for _, err in said]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in said]
