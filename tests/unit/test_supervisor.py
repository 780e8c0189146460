"""One cell's supervision (kernel/supervision/supervisor.py) with everything real but the processes: the
rank server, the mux, the verdict, the relay, the board and the data plane are the product's; each
rank is two real pipes the test writes to and closes and an exit code it sets, and a rank that
talks connects to the rank server as a rank does (wire.py's handshake, protocol.py's frames)."""

import os
import threading
import time
from typing import Callable

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from taas_magic import protocol, wire
from taas_magic.cell.pragma import PragmaOptions, settle
from taas_magic.errors import RankFailed, RunTimeout, TrialPruned, WorkerFailed
from taas_magic.kernel.supervision.attempts import run_ranks
from taas_magic.kernel.supervision.dataplane import DataRun
from taas_magic.kernel.supervision.restarts import Attempts, Restarting
from taas_magic.kernel.supervision.server import PeerServer
from taas_magic.kernel.supervision.supervisor import RunOutcome, RunParts
from taas_magic.output.board import Board
from taas_magic.output.relay import Display, OutputRelay
from taas_magic.output.reports import Report
from taas_magic.peers import PeerIds
from taas_magic.transfer.returns import Released, Result
from tests.unit.recording import WrittenText

SESSION = {"cache_ram": "64M", "ahead": 16, "timeout": None, "hang": 30.0, "restarts": 0, "place_timeout": 60.0, "output": "rank0", "keep": False}
WAIT = 10.0  # seconds a condition may take on a loaded machine


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def no_fd_left():
    """Every run closes what it opened: its selector, its wake pipe, the channels it accepted."""
    before = _open_fds()
    yield
    assert _open_fds() == before


class _Child:
    """A rank (or data worker) as the supervisor sees it: two real pipes and an exit code, no process.

    The test (or a thread playing the rank) prints into the pipes and ends it with :meth:`exit`;
    the group ends one that still runs the way a signal would."""

    def __init__(self, index: int):
        self.index, self.host, self.exit_fd = index, "host-a", None
        self.stdout_fd, self.out = os.pipe()
        self.stderr_fd, self.err = os.pipe()
        self.code: int | None = None
        self.lock = threading.Lock()  # the rank's thread and the supervisor's stop may end it at once

    def print(self, text: str, stream: str = "stdout") -> None:
        with self.lock:
            fd = self.out if stream == "stdout" else self.err
            if fd >= 0:
                os.write(fd, text.encode())

    def exit(self, code: int) -> None:
        """Its pipes close, then its exit code is there to poll, as a process's are."""
        with self.lock:
            if self.code is not None:
                return
            for fd in (self.out, self.err):
                os.close(fd)
            self.out = self.err = -1
            self.code = code

    def poll(self) -> int | None:
        return self.code


class _Group:
    """A launcher's process group of ``_Child`` ren: ``stop`` and ``close`` recorded and done as a
    group does them (close stops what still runs, then releases every fd)."""

    def __init__(self, count: int):
        self.children = [_Child(index) for index in range(count)]
        self.calls: list = []
        self.closed = False

    def interrupt(self, ranks) -> None:
        self.calls.append(("interrupt", tuple(ranks)))

    def stop(self, graceful: bool = True) -> list[str]:
        self.calls.append(("stop", graceful))
        for child in self.children:
            child.exit(-2 if graceful else -15)  # SIGINT first when graceful, else SIGTERM
        return ["INT" if graceful else "TERM"]

    def stacks(self, ranks) -> dict[int, str]:
        return {rank: f"stack of rank {rank}" for rank in ranks}

    def close(self) -> None:
        self.calls.append("close")
        if self.closed:
            return
        self.closed = True
        for child in self.children:
            child.exit(-9)
            os.close(child.stdout_fd)
            os.close(child.stderr_fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class _Cell:
    """What a run shows: the relay's two streams and the published displays."""

    def __init__(self, ids: PeerIds, output: str):
        self.ids, self.output = ids, output
        self.streams = {"stdout": WrittenText(), "stderr": WrittenText()}
        self.displays: list = []

    def relay(self, on_marker) -> OutputRelay:
        return OutputRelay(self.output, self.ids, self.streams, on_marker=on_marker)

    def publish(self, message) -> None:
        self.displays.append(message)


@pytest.fixture
def server():
    server = PeerServer(wire.new_key(), 4)
    yield server
    server.close()


def _parts(server: PeerServer, cell: _Cell, **given) -> RunParts:
    return RunParts(server=server, ids=cell.ids, greeting=lambda peer: [protocol.encode(Released())],
                    relay=cell.relay, publish=cell.publish, host_copy=_no_host_copy, **given)


def _no_host_copy(rank, frame):
    raise AssertionError("no rank here asks for a host copy")


def _starts(*groups: _Group):
    """``start(attempt)`` giving each group in turn, the attempts it was asked for in ``.asked``."""
    pending = list(groups)

    def start(attempt: int) -> _Group:
        start.asked.append(attempt)
        return pending.pop(0)

    start.asked = []
    return start


def _result() -> Result:
    return Result(skeleton=b"names", segments=[], failed=[], deleted=[], places=[], data=None, ipc=[], cuda_host=(0, 0, ""))


def _talking_rank(server: PeerServer, child: _Child, frames: list, errors: list,
                  together: threading.Barrier | None = None,
                  meanwhile: Callable[[], None] | None = None) -> threading.Thread:
    """A rank that connects and proves the key as rank/startup.py does, takes its greeting, waits
    for the ranks ``together`` with it (their rendezvous), sends ``frames``, prints around them and
    exits 0; or, given ``meanwhile``, does that instead and stays until its group ends it."""

    def play() -> None:
        try:
            channel = protocol.PeerChannel(wire.BlockingChannel.connect(*server.address, server.key, child.index))
            try:
                assert channel.receive() == Released()  # its greeting
                child.print(f"rank {child.index} connected\n")
                if together is not None:
                    together.wait(WAIT)
                if meanwhile is not None:
                    meanwhile()
                    _until(lambda: child.code is not None)
                    return
                for frame in frames:
                    channel.send(frame)
                child.print(f"rank {child.index} sent {len(frames)} frames\n")
            finally:
                channel.close()
            child.exit(0)
        except BaseException as exc:  # noqa: BLE001 - the test thread reports it
            errors.append(exc)
            child.exit(1)

    thread = threading.Thread(target=play, daemon=True)
    thread.start()
    return thread


def _until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT
    while not done():
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_a_ranks_lines_reach_the_cell_in_order_and_clean_exits_are_the_outcome(server):
    cell = _Cell(PeerIds(2), "rank0")
    group = _Group(2)
    lines = [f"step {n}\n" for n in range(200)]
    for line in lines:
        group.children[0].print(line)
    group.children[0].print("a bar 50%\r")
    group.children[1].print("rank 1 is not shown with --output rank0\n")
    for child in group.children:
        child.exit(0)
    outcome = run_ranks(_parts(server, cell), Restarting(_starts(group)))
    assert outcome == RunOutcome(None, {0: 0, 1: 0})
    assert cell.streams["stdout"].text == "".join(lines) + "a bar 50%\r"  # \r kept
    assert cell.streams["stderr"].text == ""
    assert group.calls == ["close"]


def test_with_output_all_each_ranks_lines_are_whole_and_named(server):
    cell = _Cell(PeerIds(2), "all")
    group = _Group(2)
    group.children[0].print("zero ")
    group.children[1].print("one\n")
    group.children[0].print("whole\n")
    group.children[1].print("warning\n", "stderr")
    group.children[1].print("no newline at the end")
    for child in group.children:
        child.exit(0)
    run_ranks(_parts(server, cell), Restarting(_starts(group)))
    assert sorted(cell.streams["stdout"].text.splitlines()) == [
        "[rank 0] zero whole", "[rank 1] no newline at the end", "[rank 1] one"]
    assert cell.streams["stderr"].text == "[rank 1] warning\n"


def test_rank_0s_result_and_reports_arrive_over_the_channel_and_running_is_said_once_all_connected(server):
    cell = _Cell(PeerIds(2), "rank0")
    board = Board(2, cell.publish)
    group = _Group(2)
    report = Report(0.0, [(1, {"loss": 0.5}), (2, {"loss": 0.25})], None)
    running: list[bool] = []
    errors: list = []
    together = threading.Barrier(2)
    threads = [_talking_rank(server, group.children[0], [report, _result()], errors, together),
               _talking_rank(server, group.children[1], [Report(0.0, [(1, {"loss": 0.75})], None)], errors, together)]
    outcome = run_ranks(_parts(server, cell, board=board), Restarting(_starts(group), Attempts(running=running.append)))
    for thread in threads:
        thread.join(WAIT)
    assert errors == []
    assert outcome.result == _result() and outcome.exit_codes == {0: 0, 1: 0}
    assert board.metrics() == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
    assert running == [False]  # --restarts 0: a failure would not start them again
    assert cell.streams["stdout"].text == "rank 0 connected\nrank 0 sent 2 frames\n"
    assert any(isinstance(shown, Display) and "image/svg+xml" in shown.data for shown in cell.displays)  # the chart


def test_a_rank_that_exits_1_fails_the_run_naming_it_with_its_last_output_and_every_rank_is_stopped(server):
    cell = _Cell(PeerIds(2), "rank0")
    group = _Group(2)
    group.children[1].print("loading\n")
    group.children[1].print("about to fail\n", "stderr")
    group.children[1].exit(1)  # rank 0 still runs
    with pytest.raises(RankFailed) as failed:
        run_ranks(_parts(server, cell), Restarting(_starts(group)))
    error = failed.value
    assert error.rank == 1 and str(error) == "rank 1 on host-a exited with code 1 without reporting an error"
    assert error.last_lines == ("loading", "about to fail")
    assert group.calls == [("stop", True), "close"]  # no restart: every rank stopped gracefully
    assert group.children[0].code == -2


def test_a_stop_asked_is_an_interrupt_that_says_where_the_ranks_were_and_closes_their_group(server):
    cell = _Cell(PeerIds(2), "rank0")
    group = _Group(2)
    group.children[0].print("training\n")
    explained: list = []

    def explain(stacks, running) -> list[str]:
        explained.append((stacks, running))
        return [f"rank {rank} was in train()" for rank in running]

    asked = iter([False, False, True])
    parts = _parts(server, cell, explain=explain, stop_asked=lambda: next(asked, True))
    with pytest.raises(KeyboardInterrupt):
        run_ranks(parts, Restarting(_starts(group), Attempts(restarts=2)))
    assert explained == [({0: "stack of rank 0", 1: "stack of rank 1"}, (0, 1))]
    assert cell.streams["stdout"].text == "training\n"
    assert cell.streams["stderr"].text == "rank 0 was in train()\nrank 1 was in train()\n"
    assert group.calls == [("interrupt", (0, 1)), "close"]  # never restarted; SIGINT, then the close ends every rank
    assert [child.code for child in group.children] == [-9, -9]


def test_the_timeout_fails_the_run_naming_the_ranks_still_running_and_where_they_were(server):
    cell = _Cell(PeerIds(3), "rank0")
    group = _Group(3)
    group.children[0].exit(0)
    parts = _parts(server, cell, timeout=0.2, explain=lambda stacks, running: [f"{stacks[rank]}: in recv" for rank in running])
    with pytest.raises(RunTimeout) as timed_out:
        run_ranks(parts, Restarting(_starts(group)))
    error = timed_out.value
    assert error.running == (1, 2) and "ranks still running: 1, 2" in str(error)
    assert error.notes == ("stack of rank 1: in recv", "stack of rank 2: in recv")
    assert group.calls == [("stop", True), "close"]


def test_a_timeout_without_an_autopsy_names_the_ranks_only(server):
    cell = _Cell(PeerIds(1), "rank0")
    group = _Group(1)
    with pytest.raises(RunTimeout) as timed_out:
        run_ranks(_parts(server, cell, timeout=0.05), Restarting(_starts(group)))
    assert timed_out.value.running == (0,) and timed_out.value.notes == ()


def test_the_pruner_stops_every_rank_at_once(server):
    cell = _Cell(PeerIds(2), "rank0")
    group = _Group(2)
    pruned = iter([False, True])
    parts = _parts(server, cell, prune_asked=lambda: next(pruned, True), explain=_never_explained)
    with pytest.raises(TrialPruned):
        run_ranks(parts, Restarting(_starts(group), Attempts(restarts=1)))
    assert group.calls == [("stop", False), "close"]  # TERM then KILL, no autopsy, no restart


def _never_explained(stacks, running):
    raise AssertionError("a pruned trial has no autopsy")


def test_a_failed_attempt_is_stopped_at_once_and_its_ranks_may_connect_again_in_the_next(server):
    cell = _Cell(PeerIds(2), "rank0")
    first, second = _Group(2), _Group(2)
    errors: list = []
    threads: list[threading.Thread] = []
    start = _starts(first, second)

    def between(attempt: int) -> None:  # the first attempt's ranks are gone: the second's start
        threads.extend(_talking_rank(server, child, [], errors) for child in second.children)

    # the first attempt's rank 0 is connected when rank 1 is killed
    threads.append(_talking_rank(server, first.children[0], [], errors, meanwhile=lambda: first.children[1].exit(-9)))
    outcome = run_ranks(_parts(server, cell), Restarting(start, Attempts(restarts=1, between=between)))
    for thread in threads:
        thread.join(WAIT)
    assert errors == [] and start.asked == [0, 1]
    assert outcome.exit_codes == {0: 0, 1: 0}
    assert first.calls == [("stop", False), "close"] and second.calls == ["close"]
    assert [child.code for child in first.children] == [-15, -9]
    assert cell.streams["stderr"].text == ("taas: attempt 1 of 2 failed: rank 1 was killed by SIGKILL; "
                                          "restarting every rank (attempt 2 of 2)\n")
    # the new rank 0 proved the key as rank 0 again (the server readmitted it)
    assert cell.streams["stdout"].text == "rank 0 connected\nrank 0 connected\nrank 0 sent 0 frames\n"
    assert server.rejected == 0


def _data_run(tmp_path, monkeypatch, ranks: int) -> DataRun:
    monkeypatch.setenv("TAAS_SPILL_DIR", str(tmp_path))
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    settings = settle(PragmaOptions(gpus=ranks, device="cpu", cpus=1), SESSION, ranks=ranks)
    return DataRun({0: loader}, {"train_loader": loader}, settings)


def test_the_data_workers_outlive_the_ranks_and_are_closed_with_the_run(server, tmp_path, monkeypatch):
    data = _data_run(tmp_path, monkeypatch, ranks=2)
    cell = _Cell(PeerIds(2, data.workers), "rank0")
    workers, ranks = _Group(1), _Group(2)
    workers.children[0].print("a worker's line is not shown with --output rank0\n")
    for child in ranks.children:
        child.exit(0)
    data.prepare("run1", "handshake", cell.ids, {}, _rule(tmp_path))
    try:
        outcome = run_ranks(_parts(server, cell), Restarting(_starts(ranks)), lambda: data.start(workers, None, cell.publish))
    finally:
        data.close()
    assert outcome.exit_codes == {0: 0, 1: 0}
    assert workers.calls == ["close"]  # still extracting when the ranks ended: stopped with the run
    lines = [shown.data["text/plain"] for shown in cell.displays]
    assert lines[0].startswith("taas data (1 worker) · train_loader: 0/4 extracted")
    assert "cache" in lines[-1] and "in RAM" in lines[-1]  # the last line measures the cache
    assert cell.streams["stdout"].text == ""


def test_a_data_workers_exit_before_done_fails_the_run_and_stops_the_workers_too(server, tmp_path, monkeypatch):
    data = _data_run(tmp_path, monkeypatch, ranks=1)
    cell = _Cell(PeerIds(1, data.workers), "rank0")
    workers, ranks = _Group(1), _Group(1)
    workers.children[0].exit(0)
    data.prepare("run2", "handshake", cell.ids, {}, _rule(tmp_path))
    try:
        with pytest.raises(WorkerFailed) as failed:
            run_ranks(_parts(server, cell), Restarting(_starts(ranks), Attempts(restarts=3)),
                      lambda: data.start(workers, None, cell.publish))
    finally:
        data.close()
    assert str(failed.value) == "data worker 0 on host-a exited before preparing its share of the elements"
    assert ranks.calls == [("stop", True), "close"]  # a worker's failure is not restarted
    assert workers.calls == [("stop", True), "close"]


def _rule(tmp_path):
    from taas_magic.writes.rule import choose_rule

    return choose_rule(str(tmp_path / "repo"), "python")


def test_the_boards_two_displays_go_out_once_whichever_thread_starts_it_first():
    """The cell's thread starts the board under the header (kernel/runs/background.py's begin); the run's thread
    then starts it again (supervisor.py's show_start, from the policy's start), which adds nothing."""
    shown: list = []
    board = Board(2, shown.append)
    board.start()
    board.start()
    assert [message.transient["display_id"] for message in shown] == [board.health_id, board.chart_id]
    assert [message.update for message in shown] == [False, False]
