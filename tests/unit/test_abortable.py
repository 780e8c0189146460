"""rank/abortable.py in two real processes over real gloo: a collective one rank waits in for a rank that never
comes ends when the group is aborted, the group is renewed under the same object and every kind of collective torch
issues works on it (DDP, FSDP2 over a DeviceMesh, DTensor's functional collectives), and abort after abort leaves
the process's open files and threads where they were.

Each rank is a spawned process (torch.multiprocessing), its store the parent's TCPStore, as a kept rank's is rank
0's; what each rank saw comes back on a queue."""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

ROUNDS = 6


def _rank(rank: int, port: int, said) -> None:  # noqa: ANN001 - a multiprocessing queue
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from taas_magic.rank import abortable

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      TORCHELASTIC_USE_AGENT_STORE="True")
    abortable.register()
    dist.init_process_group(abortable.BACKEND, timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    sharded = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    optimizer = torch.optim.Adam(sharded.parameters(), lr=0.1)

    def train() -> tuple:
        ddp(torch.ones(2, 4)).sum().backward()
        sharded(torch.ones(2, 4) * (rank + 1)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        full = sharded[0].weight.full_tensor()  # DTensor's all-gather (a functional collective)
        weights = [torch.zeros(4) for _ in range(2)]
        dist.all_gather(weights, ddp.module.weight.detach().flatten())
        return tuple(full.shape), torch.equal(weights[0], weights[1]), ddp.module.weight.grad.flatten()[0].item()

    first = train()
    peers = dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60))
    footprint = None
    left_after = []
    for round_ in range(ROUNDS):
        dist.barrier()
        if rank == 0:
            aborted_at: list[float] = []
            aborter = threading.Thread(target=_abort_once_waiting, args=(abortable, aborted_at, peers, round_), daemon=True)
            aborter.start()
            try:
                if round_ % 2:
                    ddp(torch.ones(2, 4)).sum().backward()  # its future completes: the interrupt would raise here
                    dist.all_reduce(torch.ones(1))  # the group is abandoned now: this raises at once
                else:
                    dist.all_reduce(torch.ones(1))
            except abortable.Aborted:
                left_after.append(time.monotonic() - aborted_at[0])
            aborter.join(timeout=60)  # the test's own thread: not counted as the process's footprint
        else:
            peers.wait([f"aborted{round_}"])  # the kernel's Abandon reaches rank 1 after rank 0, whatever the load:
            abortable.abort_all("rank 1 raised")  # rank 0 leaves its collective by its own abort (the error it says)
        abortable.renew_all(f"run{round_}")
        renewed = dist.group.WORLD._get_backend(torch.device("cpu")) is dist.group.WORLD._current.gloo
        again = train()
        if round_ == 1:
            footprint = _reaped(abortable)
    after = _reaped(abortable)
    said.put((rank, first, again + (renewed,), left_after, footprint, after,
              dist.group.WORLD.renewals, abortable.reaper.pending()))
    said.close()
    said.join_thread()  # what it said is sent before the process ends
    dist.barrier()
    os._exit(0)  # as a rank ends (rank/startup.py's finish): no interpreter teardown under gloo's threads


def _reaped(abortable) -> tuple[int, int]:  # noqa: ANN001 - the module
    """The process's open files and threads once the aborted communicators are destroyed (a second after their
    abort, and their stuck ops' end) and the reaper's thread is over: a thread that returned leaves /proc a moment
    later, so they are read until two readings agree."""
    deadline = time.monotonic() + 30
    while abortable.reaper.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    for thread in threading.enumerate():
        if thread.name == "taas-reaper":
            thread.join(timeout=30)
    seen = None
    while time.monotonic() < deadline:
        now = (len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")))
        if now == seen:
            return now
        seen = now
        time.sleep(0.1)
    return seen


def _abort_once_waiting(abortable, aborted_at: list[float], peers, round_: int) -> None:  # noqa: ANN001 - module, store
    """The kernel's Abandon on rank 0, once its collective is waiting (whatever the machine's load)."""
    group = dist.group.WORLD
    deadline = time.monotonic() + 60
    while not group._current.unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # it waits
    aborted_at.append(time.monotonic())
    abortable.abort_all("rank 1 raised")
    peers.set(f"aborted{round_}", "1")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="finds a communicator's sockets in Linux's /proc")
def test_an_aborted_collective_ends_at_once_and_the_renewed_group_trains_ddp_and_fsdp2_without_leaking():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    context = mp.get_context("spawn")
    said = context.Queue()
    ranks = [context.Process(target=_rank, args=(rank, port, said)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        results = dict((result[0], result[1:]) for result in (said.get(timeout=240) for _ in ranks))
        for process in ranks:
            process.join(timeout=60)
        assert [process.exitcode for process in ranks] == [0, 0]
    finally:
        for process in ranks:
            process.kill()
        del store
    for rank, (first, again, left_after, footprint, after, renewals, pending) in results.items():
        assert first[:2] == ((8, 4), True) and again[:2] == ((8, 4), True), (rank, first, again)
        assert again[-1], "the group's backend, as Python asks it (a pdb hold's timeout), is not the current one"
        assert renewals == ROUNDS and pending == 0
        assert after == footprint, f"rank {rank}: open files and threads {footprint} -> {after} over {ROUNDS - 2} aborts"
    assert len(results[0][2]) == ROUNDS and all(0 <= seconds < 0.5 for seconds in results[0][2]), results[0][2]
