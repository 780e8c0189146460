"""A data worker's life (feed/worker.py), the test playing the kernel's end of its channel.

Two ways, both real: the :class:`Worker` loop on a thread of this process, over an authenticated
socket pair (wire.py's frames), with real torch DataLoaders over synthetic datasets, real segment
files and the records read back as a rank reads them; and ``python -m taas_magic.feed.worker``
started as the kernel starts it (its own session, the handshake and placement on its stdin, a loopback
listener that checks its key), given its job and loaders pickled as the kernel pickles them.

What is pinned down: a map-style feed prepares elements ``j % M == w`` of each fresh pass, no further
than the kernel's horizon, RAM segments first; an iterable feed counts what the kernel has not yet
counted against the horizon, says when its pass is exhausted, waits for ``NextPass`` and stops at
``Stop``; one feed held back does not hold back another; a worker with nothing left sends ``Done`` and
exits 0; one that fails sends its traceback with the element it was preparing (or its setup) and
exits 1."""

import os
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset, get_worker_info
from torch.utils.data._utils import worker as torch_worker

from taas_magic import protocol, wire
from taas_magic.feed.plan import FeedTerms, plan_feed
from taas_magic.feed.worker import Worker
from taas_magic.protocol import (
    Done,
    Exhausted,
    Horizon,
    Job,
    Loaders,
    NextPass,
    PeerChannel,
    Ready,
    Stop,
    ToKernel,
    WorkerFailure,
)
from taas_magic.transfer import pickler
from taas_magic.transfer.records import SegmentReader

ROOT = Path(__file__).resolve().parents[2]
SECONDS = 60  # at most, for what must come (a loaded machine); what must not come is awaited QUIET
QUIET = 0.3


@pytest.fixture(autouse=True)
def process_state():
    """A worker seeds the process's RNGs and sets its worker info: put back after each test."""
    states = random.getstate(), torch.get_rng_state(), np.random.get_state()
    yield
    torch_worker._worker_info = None
    random.setstate(states[0])
    torch.set_rng_state(states[1])
    np.random.set_state(states[2])


@pytest.fixture
def reader():
    reader = SegmentReader()
    yield reader
    reader.close()


class Sharded(IterableDataset):
    """Numbers 0..n-1, each worker of get_worker_info() taking its own."""

    def __init__(self, n: int):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))


class _Kernel:
    """The kernel's end of one worker's channel: typed frames, as the kernel's mux sends and reads them."""

    def __init__(self, channel: wire.BlockingChannel):
        self.channel = channel

    def send(self, frame: protocol.ToPeer) -> None:
        self.channel.send(frame.KIND, wire.dumps(frame))

    def receive(self) -> ToKernel:
        assert self.channel.readable(SECONDS), "the worker sent nothing"
        return protocol.decode(*self.channel.recv(), ToKernel)

    def receive_until(self, last: type) -> list[ToKernel]:
        frames = [self.receive()]
        while not isinstance(frames[-1], last):
            frames.append(self.receive())
        return frames

    def quiet(self) -> bool:
        return not self.channel.readable(QUIET)


def _in_process(job: Job, loaders: dict) -> tuple[_Kernel, threading.Thread, list]:
    """A :class:`Worker` running on a thread, over a socket pair with one key both ways."""
    worker_end, kernel_end = socket.socketpair()
    key, nonce = wire.new_key(), os.urandom(wire.NONCE_SIZE)
    channel = PeerChannel(wire.BlockingChannel(worker_end, wire.FrameCodec(
        key, nonce, outgoing=wire.RANK_TO_KERNEL, incoming=wire.KERNEL_TO_RANK)))
    kernel = _Kernel(wire.BlockingChannel(kernel_end, wire.FrameCodec(
        key, nonce, outgoing=wire.KERNEL_TO_RANK, incoming=wire.RANK_TO_KERNEL)))
    worker = Worker(channel, job, loaders)
    thread = threading.Thread(target=worker.run, name="data worker", daemon=True)
    thread.start()
    return kernel, thread, [channel, kernel.channel]


def _close(thread: threading.Thread, channels: list) -> None:
    thread.join(SECONDS)
    assert not thread.is_alive(), "the worker did not end"
    for channel in channels:
        channel.close()


def _job(tmp_path, plans, worker=0, workers=1, ram_budget=1 << 30, segment_bytes=1 << 20) -> Job:
    for name in ("ram", "disk"):
        (tmp_path / name).mkdir(exist_ok=True)
    return Job(worker, workers, 5, plans, (str(tmp_path / "ram"), str(tmp_path / "disk")), ram_budget, segment_bytes,
               list(sys.path))


def _terms(units=None, ranks=2, workers=1, ahead=1) -> FeedTerms:
    return FeedTerms(units=units, ranks=ranks, workers=workers, seed=3, ahead=ahead)


def _element(reader: SegmentReader, ready: Ready):
    return reader.read(ready.path, ready.offset)


def test_a_map_feed_is_prepared_no_further_than_the_kernels_horizon(tmp_path, reader):
    loader = DataLoader(TensorDataset(torch.arange(20)), batch_size=2)  # 10 elements
    plan = plan_feed(0, "train", loader, _terms(ranks=2, ahead=1))  # the horizon starts at ahead x ranks = 2
    kernel, thread, channels = _in_process(_job(tmp_path, [plan]), {0: loader})
    try:
        first = [kernel.receive(), kernel.receive()]
        assert [(f.feed, f.pass_no, f.index) for f in first] == [(0, 0, 0), (0, 0, 1)]
        assert kernel.quiet()  # held back at the horizon
        kernel.send(Horizon(0, 6, 0, 0))
        more = [kernel.receive() for _ in range(4)]
        assert [f.index for f in more] == [2, 3, 4, 5] and kernel.quiet()
        kernel.send(Horizon(0, 100, 0, 0))
        rest = kernel.receive_until(Done)
        assert [f.index for f in rest[:-1]] == [6, 7, 8, 9] and rest[-1] == Done(0)
    finally:
        _close(thread, channels)
    for ready in first + more + rest[:-1]:
        (batch,) = _element(reader, ready)
        assert batch.tolist() == [2 * ready.index, 2 * ready.index + 1]  # element j of the pass, as the loader yields it
        assert os.path.dirname(ready.path) == str(tmp_path / "ram")


def test_each_worker_prepares_its_own_elements_of_every_fresh_pass_ram_first_then_disk(tmp_path, reader):
    loader = DataLoader(TensorDataset(torch.arange(12)), batch_size=2, shuffle=True)  # L = 6, shuffled; 192-byte records
    plan = plan_feed(0, "train", loader, _terms(units=15, ranks=2, workers=2, ahead=100))
    assert [plan.fresh_length(p) for p in range(plan.fresh_passes)] == [6, 6, 2]
    readies = {}
    for w in range(2):  # one after the other: the horizon lets each finish alone
        kernel, thread, channels = _in_process(_job(tmp_path, [plan], w, 2, ram_budget=512, segment_bytes=512),
                                               {0: loader})
        try:
            frames = kernel.receive_until(Done)
        finally:
            _close(thread, channels)
        assert frames[-1] == Done(w) and all(isinstance(f, Ready) for f in frames[:-1])
        readies[w] = frames[:-1]
        assert all(f.index % 2 == w for f in readies[w])
        assert [f.pass_no for f in readies[w]] == sorted(f.pass_no for f in readies[w])  # pass after pass
        folders = [os.path.basename(os.path.dirname(f.path)) for f in readies[w]]
        assert folders[0] == "ram" and folders[-1] == "disk" and folders == sorted(folders, key=["ram", "disk"].index)
        assert {os.path.basename(f.path).split("-")[0] for f in readies[w]} == {f"w{w}"}
    by_pass: dict = {}
    for ready in readies[0] + readies[1]:
        by_pass.setdefault(ready.pass_no, {})[ready.index] = _element(reader, ready)[0].tolist()
    assert {p: sorted(js) for p, js in by_pass.items()} == {0: list(range(6)), 1: list(range(6)), 2: [0, 1]}
    orders = [[x for j in range(6) for x in by_pass[p][j]] for p in (0, 1)]
    assert sorted(orders[0]) == sorted(orders[1]) == list(range(12))  # both workers drew the same order
    assert orders[0] != orders[1]  # a new one for each pass


def test_an_iterable_feed_counts_against_the_horizon_and_waits_for_each_pass(tmp_path, reader):
    loader = DataLoader(Sharded(10), batch_size=2)
    plan = plan_feed(0, "stream", loader, _terms(units=100, ranks=2, workers=2, ahead=1))
    kernel, thread, channels = _in_process(_job(tmp_path, [plan], worker=1, workers=2), {0: loader})
    try:
        first = [kernel.receive(), kernel.receive()]
        assert kernel.quiet()  # 2 of its own not yet counted: the horizon of 2 is reached
        kernel.send(Horizon(0, 10, 3, 2))  # 3 arrived from all the workers, both of its own counted
        pass0 = kernel.receive_until(Exhausted)
        assert pass0[-1] == Exhausted(0, 0) and kernel.quiet()  # its pass is over: it waits for the others'
        kernel.send(NextPass(0, 1))
        pass1 = kernel.receive_until(Exhausted)
        assert pass1[-1] == Exhausted(0, 1) and kernel.quiet()
        kernel.send(Stop(0))
        assert kernel.receive() == Done(1)
    finally:
        _close(thread, channels)
    readies = first + pass0[:-1]
    assert all(f.index is None for f in readies + pass1[:-1])  # numbered by arrival, in the kernel
    assert [f.pass_no for f in readies] == [0, 0, 0] and [f.pass_no for f in pass1[:-1]] == [1, 1, 1]
    # worker 1 of 2: the dataset shards by get_worker_info(), as under DataLoader workers
    assert [_element(reader, f).tolist() for f in readies] == [[1, 3], [5, 7], [9]]
    assert [_element(reader, f).tolist() for f in pass1[:-1]] == [[1, 3], [5, 7], [9]]


def test_a_feed_held_at_its_horizon_does_not_hold_back_another(tmp_path, reader):
    held = DataLoader(TensorDataset(torch.arange(8)), batch_size=1)
    free = ["a", "b", "c", "d"]
    plans = [plan_feed(0, "held", held, _terms(ranks=2, ahead=1)), plan_feed(1, "free", free, _terms(ranks=2, ahead=50))]
    kernel, thread, channels = _in_process(_job(tmp_path, plans), {0: held, 1: free})
    try:
        frames = [kernel.receive() for _ in range(6)]
        assert kernel.quiet()  # the held feed is not done: no Done
        assert [f.index for f in frames if f.feed == 0] == [0, 1]
        assert [_element(reader, f) for f in frames if f.feed == 1] == ["a", "b", "c", "d"]
        kernel.send(Horizon(0, 8, 0, 0))
        rest = kernel.receive_until(Done)
        assert [f.index for f in rest[:-1]] == list(range(2, 8)) and {f.feed for f in rest[:-1]} == {0}
    finally:
        _close(thread, channels)


# -- the process, as the kernel starts it ---------------------------------------------------------------
class _Started:
    """``python -m taas_magic.feed.worker`` in its own session, connected and proven to a loopback listener."""

    def __init__(self, peer_id: int):
        key = wire.new_key()
        self.listener = socket.create_server((wire.LOOPBACK, 0))
        self.listener.settimeout(SECONDS)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "taas_magic.feed.worker"], cwd=ROOT, start_new_session=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)})
        self.kernel: _Kernel | None = None
        host, port = self.listener.getsockname()
        lines = [wire.Handshake(host, port, key).line(), wire.Placement(peer_id, "data worker 0").line()]
        self.process.stdin.write(("\n".join(lines) + "\n").encode())
        self.process.stdin.flush()  # stdin stays open: the worker's lifeline
        sock, _ = self.listener.accept()
        sock.settimeout(SECONDS)
        hello = wire.Hello.greet(sock)
        while hello.read(key, lambda proved: proved == peer_id) is None:
            pass
        sock.settimeout(None)
        self.kernel = _Kernel(wire.BlockingChannel(sock, wire.FrameCodec(
            key, hello.nonce, outgoing=wire.KERNEL_TO_RANK, incoming=wire.RANK_TO_KERNEL)))

    def exit_code(self) -> tuple[int, str]:
        """Its exit code (it leaves on its own), and what it wrote to stderr."""
        code = self.process.wait(SECONDS)
        _, err = self.process.communicate(timeout=SECONDS)
        return code, err.decode()

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the group is the worker's
        self.process.communicate(timeout=SECONDS)
        if self.kernel is not None:
            self.kernel.channel.close()
        self.listener.close()


@pytest.fixture
def started():
    made = []

    def start(peer_id: int = 2) -> _Started:
        made.append(_Started(peer_id))
        return made[-1]

    yield start
    for worker in made:
        worker.close()


def test_the_worker_process_prepares_its_job_says_done_and_exits_0(tmp_path, started, reader):
    loader = [{"word": word, "n": n} for n, word in enumerate(["zero", "one", "two", "three", "four"])]
    plan = plan_feed(0, "words", loader, _terms(ranks=2, ahead=10))  # 5 a pass, 2 ranks: 4 delivered
    worker = started(peer_id=2)  # the first worker after 2 ranks
    worker.kernel.send(_job(tmp_path, [plan]))
    worker.kernel.send(Loaders({0: pickler.dumps(loader)}))
    frames = worker.kernel.receive_until(Done)
    assert frames[-1] == Done(0) and [(f.pass_no, f.index) for f in frames[:-1]] == [(0, j) for j in range(4)]
    assert [_element(reader, f) for f in frames[:-1]] == loader[:4]
    assert worker.exit_code() == (0, "")


def test_a_worker_whose_dataset_raises_names_the_element_and_the_line_and_exits_1(tmp_path, started):
    class Broken:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            if i == 3:
                raise ValueError(f"no element {i}")
            return i

    plan = plan_feed(0, "broken", Broken(), _terms(ranks=1, ahead=10))
    worker = started(peer_id=1)
    worker.kernel.send(_job(tmp_path, [plan]))
    worker.kernel.send(Loaders({0: pickler.dumps(Broken())}))
    frames = worker.kernel.receive_until(WorkerFailure)
    assert [f.index for f in frames[:-1]] == [0, 1, 2]
    failure = frames[-1]
    assert (failure.feed, failure.element, failure.exception) == (0, "element 3 of pass 0", "ValueError: no element 3\n")
    filename, _, function, line = failure.frames[-1]  # the notebook's own frame, with its source line
    assert (filename, function, line) == (__file__, "__getitem__", 'raise ValueError(f"no element {i}")')
    assert worker.exit_code()[0] == 1


def test_an_iterable_worker_that_fails_counts_its_element_within_the_pass(tmp_path, started):
    class Flaky:
        def __iter__(self):
            yield "a"
            yield "b"
            raise RuntimeError("the source went away")

    plan = plan_feed(0, "flaky", Flaky(), _terms(units=10, ranks=1, ahead=10))
    worker = started(peer_id=1)
    worker.kernel.send(_job(tmp_path, [plan]))
    worker.kernel.send(Loaders({0: pickler.dumps(Flaky())}))
    frames = worker.kernel.receive_until(WorkerFailure)
    assert len(frames) == 3 and frames[-1].element == "its element 2 of pass 0 (counting from 0)"
    assert frames[-1].exception == "RuntimeError: the source went away\n"
    assert worker.exit_code()[0] == 1


def test_a_worker_that_cannot_load_its_loaders_says_it_failed_in_its_setup(tmp_path, started):
    plan = plan_feed(0, "words", ["a", "b"], _terms(ranks=1))
    worker = started(peer_id=1)
    worker.kernel.send(_job(tmp_path, [plan]))
    worker.kernel.send(Loaders({0: b"not a pickle"}))
    failure = worker.kernel.receive()
    assert isinstance(failure, WorkerFailure)
    assert (failure.feed, failure.element) == (None, "its setup (loading the loaders)")
    assert "UnpicklingError" in failure.exception and failure.frames
    assert worker.exit_code()[0] == 1
