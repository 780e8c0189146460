"""The run loop: start, feed, watch and always reap the ranks of one cell.

It runs in the kernel's main thread, inside the magic, and installs no signal handler:
the kernel's interrupt arrives here as ``KeyboardInterrupt``, and the ``finally`` of
:func:`run_ranks` stops every rank. One selector watches everything, so there are no
threads to race: the listener, handshakes, rank channels (rich output, errors, rank
0's results), the ranks' stdout/stderr pipes and their exits (a pidfd per local
process, so the run ends the moment its last rank does, not at the next poll).
Because a rank flushes its pipes before it sends a display message, draining that
rank's pipes before publishing the message keeps text and rich output in the order
the rank produced them.

The first failure (an error frame, or a non-zero exit) stops every rank; the cell's
error names that rank. ``--timeout`` stops every rank and names those still running.

With registered loaders in use, the data workers are peers on the same channel (peers.py
numbers them after the ranks; here every process is a typed ``Peer``) and their pipes go
through the same relay; what they and the ranks say about data goes to the
:class:`DataPlane`'s coordinator, and what it answers goes back out. A worker's failure stops the run like a rank's. The run ends
when the ranks end: workers still extracting then are stopped.
"""

from __future__ import annotations

import functools
import os
import select
import selectors
import socket
import time
from dataclasses import dataclass
from typing import Callable, NoReturn

from taas_magic import protocol, wire
from taas_magic.errors import RankFailed, RunError, RunTimeout, WorkerFailed, describe_exit
from taas_magic.feed.coordinator import Send
from taas_magic.kernel.dataplane import DataPlane
from taas_magic.kernel.restarts import Attempts, refusal, restart_line
from taas_magic.kernel.server import PendingPeer, RankConnection, RankServer
from taas_magic.launch.base import RankGroup
from taas_magic.output.board import Board
from taas_magic.output.relay import OutputRelay, Publish
from taas_magic.peers import RANK, WORKER, Peer, PeerIds
from taas_magic.protocol import (
    ClearOutput,
    ClosureHostWanted,
    Display,
    Done,
    Exhausted,
    Ready,
    Report,
    Result,
    ToKernel,
    Want,
    WorkerFailure,
)
from taas_magic.transfer.handoff import answer_host_copy
from taas_magic.transfer.results import keep_result

POLL_SECONDS = 0.05
COURIER_POLL_SECONDS = 0.005
PIPE_GRACE_SECONDS = 2.0  # after every rank exited, how long to wait for pipes to close
SETTLE_SECONDS = 0.25  # after a rank's error, how long a silent death may still claim to be the cause
DRAIN_READS = 256  # at most this many reads of a pipe being drained (a leftover child may still write)

Greeting = Callable[[Peer], list[bytes]]  # the frames a peer gets once connected


@dataclass
class RunOutcome:
    result: Result | None  # rank 0's results; None if rank 0 ended with sys.exit(0)
    exit_codes: dict[int, int]


class _Loop:
    """One cell's selector over the listener, the data workers and the current attempt's ranks."""

    def __init__(
        self,
        ids: PeerIds,
        server: RankServer,
        greeting: Greeting,
        relay: OutputRelay,
        publish: Publish,
        data: DataPlane | None = None,
    ):
        self.group: RankGroup | None = None  # the current attempt's ranks (attach / detach)
        self.server = server
        self.greeting = greeting
        self.relay = relay
        self.publish = publish
        self.data = data
        self.ids = ids
        self.selector = selectors.DefaultSelector()
        self.pipes: dict[int, tuple[Peer, str]] = {}  # fd -> (peer, stream)
        self.connections: dict[Peer, RankConnection] = {}
        self.queued: dict[Peer, list[bytes]] = {}  # frames for peers not connected yet
        self.exits: dict[Peer, int] = {}  # the exit code of every process that ended
        self.failure: RunError | None = None
        self.failure_peer = Peer(RANK, 0)
        self.failure_silent = False  # the failing process died without reporting an error
        self.reported: set[Peer] = set()  # ranks that sent an error report
        self.result: Result | None = None
        self.displays: dict[tuple[Peer, int], Display | ClearOutput] = {}
        self.on_all_connected: Callable[[], None] | None = None  # once per attempt
        self.board: Board | None = None  # the live chart and health line (board.py)
        relay.on_marker = self.on_marker

    @property
    def exit_codes(self) -> dict[int, int]:
        """Each rank's exit code, by RANK (what the run's outcome reports)."""
        return {peer.index: code for peer, code in self.exits.items() if peer.is_rank}

    def _processes(self):
        """(peer, process) of every rank and data worker."""
        if self.group is not None:
            yield from ((Peer(RANK, rank.rank), rank) for rank in self.group.ranks)
        if self.data is not None:
            yield from ((Peer(WORKER, worker.rank), worker) for worker in self.data.workers.ranks)

    # -- registration -----------------------------------------------------------------
    def open(self) -> None:
        self.selector.register(self.server.listener, selectors.EVENT_READ, ("listen", None))
        for peer, process in self._processes():
            self._watch_process(peer, process)

    def _watch_process(self, peer: Peer, process) -> None:
        for name, fd in (("stdout", process.stdout_fd), ("stderr", process.stderr_fd)):
            os.set_blocking(fd, False)
            self.pipes[fd] = (peer, name)
            self.selector.register(fd, selectors.EVENT_READ, ("pipe", fd))
        if process.exit_fd is not None:
            self.selector.register(process.exit_fd, selectors.EVENT_READ, ("exit", process.exit_fd))

    def attach(self, group: RankGroup) -> None:
        """Watch an attempt's ranks."""
        self.group = group
        for rank in group.ranks:
            self._watch_process(Peer(RANK, rank.rank), rank)

    def detach(self) -> None:
        """After an attempt's ranks were stopped: forget them (the workers and their frames stay),
        so the next attempt's ranks connect, print and exit as new processes."""
        for peer in {peer for peer, _ in self.pipes.values() if peer.is_rank}:
            self.drain_pipes(peer)  # what it printed before it was stopped
        for fd, (peer, stream) in list(self.pipes.items()):
            if peer.is_rank:
                self.relay.end_of_stream(peer, stream)
                self.selector.unregister(fd)
                del self.pipes[fd]
        watched = self.selector.get_map()
        for rank in self.group.ranks if self.group is not None else ():
            if rank.exit_fd is not None and rank.exit_fd in watched:  # it had not exited yet
                self.selector.unregister(rank.exit_fd)
        for peer, connection in list(self.connections.items()):
            if peer.is_rank:
                self._close_connection(connection)
        self.server.readmit(range(self.ids.ranks))
        self.reported.clear()
        for table in (self.exits, self.queued):
            for peer in [peer for peer in table if peer.is_rank]:
                del table[peer]
        self.displays = {key: shown for key, shown in self.displays.items() if not key[0].is_rank}
        self.failure, self.failure_peer, self.failure_silent = None, Peer(RANK, 0), False
        self.result, self.group = None, None
        if self.data is not None:
            self.data.restart_ranks()

    def close(self) -> None:
        for connection in self.connections.values():
            connection.sock.close()
        for key in list(self.selector.get_map().values()):
            if key.data[0] == "hello":
                key.data[1].sock.close()
        self.selector.close()

    # -- events -------------------------------------------------------------------------
    def step(self, timeout: float) -> None:
        for key, _ in self.selector.select(timeout):
            tag, item = key.data
            if tag == "listen":
                pending = self.server.accept()
                if pending is not None:
                    self.selector.register(pending.sock, selectors.EVENT_READ, ("hello", pending))
            elif tag == "hello":
                self._on_hello(item)
            elif tag == "pipe":
                self._read_pipe(item)
            elif tag == "conn":
                self._read_connection(item)
            elif tag == "exit":  # a process ended: poll_exits (after this step) reads its code
                self.selector.unregister(item)

    def _on_hello(self, pending: PendingPeer) -> None:
        outcome = self.server.read_hello(pending)
        if outcome is None:
            return
        self.selector.unregister(pending.sock)
        if outcome is False:
            self.server.drop(pending)
            return
        assert isinstance(outcome, RankConnection)
        connection = outcome
        peer = self.ids.peer(connection.rank)  # the number it proved in its hello
        self.connections[peer] = connection
        for body in self.greeting(peer) + self.queued.pop(peer, []):
            connection.send(body)
        self.selector.register(connection.sock, selectors.EVENT_READ, ("conn", connection))
        if self.on_all_connected is not None and sum(peer.is_rank for peer in self.connections) == self.ids.ranks:
            self.on_all_connected()
            self.on_all_connected = None

    def _read_pipe(self, fd: int) -> None:
        peer, name = self.pipes[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if data:
            self.relay.feed(peer, name, data)
            return
        self.relay.end_of_stream(peer, name)
        self.selector.unregister(fd)
        del self.pipes[fd]

    def drain_pipes(self, peer: Peer) -> None:
        """Read what the process printed and is still in its pipes (bounded: a child it left may
        still hold a pipe and write to it)."""
        for fd, (owner, _) in list(self.pipes.items()):
            if owner == peer:
                for _ in range(DRAIN_READS):
                    if fd not in self.pipes or not self._pipe_has_data(fd):
                        break
                    self._read_pipe(fd)

    @staticmethod
    def _pipe_has_data(fd: int) -> bool:
        readable, _, _ = select.select([fd], [], [], 0)
        return bool(readable)

    def _read_connection(self, connection: RankConnection) -> None:
        try:
            data = connection.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close_connection(connection)
            return
        peer = self.ids.peer(connection.rank)
        try:
            frames = connection.reader.feed(data)
        except wire.AuthenticationError as exc:
            self._close_connection(connection)
            self._fail(self._failed(peer, f"sent a frame that failed authentication ({exc})"), peer)
            return
        for kind, body in frames:
            self._on_frame(peer, protocol.decode(kind, body, ToKernel))

    def drain_connection(self, peer: Peer) -> None:
        """Read every frame a process sent before it exited (its error report, say)."""
        connection = self.connections.get(peer)
        while connection is not None and peer in self.connections:
            try:
                connection.sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return  # nothing buffered, and the rank is gone: nothing more will come
            except OSError:
                pass
            self._read_connection(connection)

    def _close_connection(self, connection: RankConnection) -> None:
        self.selector.unregister(connection.sock)
        connection.sock.close()
        self.connections.pop(self.ids.peer(connection.rank), None)

    def _on_frame(self, peer: Peer, frame: ToKernel) -> None:
        if not peer.is_rank:
            self._on_worker_frame(peer, frame)
            return
        match frame:
            case Display() | ClearOutput():
                self.displays[(peer, frame.number)] = frame
            case protocol.RankError():
                self.reported.add(peer)
                self._fail(RankFailed(peer.index, self._host(peer), frame.summary, frame.traceback,
                                      signature=frame.signature), peer)
            case Report():
                if self.board is not None:
                    self.board.add(peer.index, frame)
            case Result() if peer.index == 0:
                self._on_result(peer, frame)
            case ClosureHostWanted():
                reply, line = answer_host_copy(peer.index, frame)
                self.relay.notice(line)
                self._reply(peer, reply)
            case Want() if self.data is not None:
                self._send_all(self.data.coordinator.on_rank(peer.index, frame))

    def _on_result(self, peer: Peer, message: Result) -> None:
        """Rank 0's results. CUDA storages it sent as CUDA IPC handles are copied now, while it waits
        with them alive, and it is told so; if they cannot be, it is asked to send them again through
        host memory, and that second result is the one kept (results.keep_result)."""
        kept, reply = keep_result(message)
        if reply is not None:
            self._reply(peer, reply)
        if kept is not None:
            self.result = kept

    def _reply(self, peer: Peer, body: bytes) -> bool:
        """Send ``body`` to ``peer`` if it is connected (False if it is not)."""
        connection = self.connections.get(peer)
        if connection is None:
            return False
        try:
            connection.send(body)
        except OSError:
            pass  # it has exited; its exit code tells the rest
        return True

    def _on_worker_frame(self, peer: Peer, frame: ToKernel) -> None:
        assert self.data is not None
        match frame:
            case WorkerFailure():
                name = self.data.coordinator.name_of(frame.feed)
                self._fail(WorkerFailed.from_report(peer.index, self._host(peer), name, frame), peer)
            case Ready() | Exhausted() | Done():
                self._send_all(self.data.coordinator.on_worker(peer.index, frame))

    def deliver_ready(self) -> None:
        """Cluster mode: pass on the deliveries whose elements reached their rank's host."""
        self._send_all([])

    def _send_all(self, sends: list[Send]) -> None:
        if self.data is not None and self.data.courier is not None:
            sends = self.data.courier.route(sends)
        for send in sends:
            body = protocol.encode(send.frame)
            if not self._reply(send.to, body) and send.to not in self.exits:
                self.queued.setdefault(send.to, []).append(body)

    def on_marker(self, peer: Peer, number: int) -> None:
        """A rank's display ``number`` belongs here in its text: publish it now."""
        if (peer, number) not in self.displays:
            self.drain_connection(peer)  # sent before the marker was written: it is buffered
        shown = self.displays.pop((peer, number), None)
        if shown is not None and self.relay.shows(peer):
            self.relay.flush(force=True)
            self.publish(shown)

    def publish_leftovers(self) -> None:
        """Displays whose marker never came (the cell closed fd 1): show them last."""
        for key in sorted(self.displays, key=lambda key: (self.ids.wire_id(key[0]), key[1])):
            if self.relay.shows(key[0]):
                self.relay.flush(force=True)
                self.publish(self.displays[key])
        self.displays.clear()

    def _fail(self, failure: RunError, peer: Peer, silent: bool = False) -> None:
        if silent and self.failure is not None and not self.failure_silent and self.failure_peer != peer:
            # A rank that died without a word (a signal, the OOM killer) is the root cause of the
            # errors its peers' collectives raise at the same moment, whichever the kernel read first.
            self.failure = None
        if self.failure is None:  # the root cause is the first failure
            self.failure, self.failure_peer, self.failure_silent = failure, peer, silent

    def settle(self) -> None:
        """After a failure: a moment for a silent death that caused it to be seen (see _fail)."""
        deadline = time.monotonic() + SETTLE_SECONDS
        while not self.failure_silent and not self.ranks_exited() and time.monotonic() < deadline:
            self.step(0.01)
            self.poll_exits()

    def _host(self, peer: Peer) -> str:
        if peer.is_rank:
            assert self.group is not None  # a rank's frames and exits arrive only while its attempt is attached
            return self.group.ranks[peer.index].host
        assert self.data is not None
        return self.data.workers.ranks[peer.index].host

    def _failed(self, peer: Peer, summary: str) -> RunError:
        if peer.is_rank:
            return RankFailed(peer.index, self._host(peer), summary)
        return WorkerFailed(peer.index, self._host(peer), summary)

    def poll_exits(self) -> None:
        for peer, process in self._processes():
            if peer in self.exits:
                continue
            code = process.poll()
            if code is None:
                continue
            self.exits[peer] = code
            if code != 0:
                self.drain_connection(peer)  # its error frame may still be unread
                if peer not in self.reported:
                    self._fail(self._failed(peer, describe_exit(code) + " without reporting an error"), peer, True)
            elif not peer.is_rank and not self._worker_done(peer):
                # A worker that ends cleanly before it said "done" leaves its share unprepared:
                # the ranks would wait for it forever.
                self.drain_connection(peer)
                if not self._worker_done(peer):
                    self._fail(self._failed(peer, "exited before preparing its share of the elements"), peer)

    def _worker_done(self, peer: Peer) -> bool:
        return self.data is not None and peer.index in self.data.coordinator.workers_done

    def ranks_exited(self) -> bool:
        return sum(peer.is_rank for peer in self.exits) == self.ids.ranks

    def finished(self) -> bool:
        """Every rank exited and its pipes and channel are closed (workers do not count)."""
        return (
            self.ranks_exited()
            and not any(peer.is_rank for peer, _ in self.pipes.values())
            and not any(peer.is_rank for peer in self.connections)
        )




Explain = Callable[[dict[int, str], tuple[int, ...]], list[str]]  # stack dumps, running ranks -> the autopsy's lines


def _autopsy(loop: _Loop, explain: Explain | None) -> tuple[tuple[int, ...], list[str]]:
    """The ranks still running, and where each of them is (stacks.py): one summary line, then the stacks."""
    assert loop.group is not None
    running = tuple(rank.rank for rank in loop.group.ranks if Peer(RANK, rank.rank) not in loop.exits)
    if explain is None or not running:
        return running, []
    return running, explain(loop.group.stacks(running), running)


def _watch(loop: _Loop, timeout: float | None, explain: Explain | None) -> RunOutcome | None:
    """One attempt, until every rank finished (its outcome) or it failed (None; ``loop.failure`` says how)."""
    relay, data = loop.relay, loop.data
    deadline = None if timeout is None else time.monotonic() + timeout
    all_exited_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            wait = min(POLL_SECONDS, relay.seconds_until_flush(now))
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - now))
            if data is not None and data.courier is not None and data.courier.busy:
                wait = min(wait, COURIER_POLL_SECONDS)  # its copies complete off the selector
            loop.step(wait)
            if data is not None and data.courier is not None:
                loop.deliver_ready()
            loop.poll_exits()
            relay.flush()
            if data is not None:
                data.progress.show()
            if loop.board is not None:
                loop.board.show()
            if loop.failure is not None:
                loop.settle()
                return None
            if loop.finished():
                break
            now = time.monotonic()
            if loop.ranks_exited():
                all_exited_at = all_exited_at or now
                if now - all_exited_at > PIPE_GRACE_SECONDS:
                    break  # something the cell started still holds a pipe open: the group's close ends it
            if deadline is not None and now >= deadline:
                assert timeout is not None  # a deadline exists only with a timeout
                running, lines = _autopsy(loop, explain)
                failure = RunTimeout(timeout, running)
                failure.notes = tuple(lines)
                loop._fail(failure, Peer(RANK, running[0] if running else 0))
                return None
    except KeyboardInterrupt:
        relay.flush(force=True)
        for line in _autopsy(loop, explain)[1]:
            relay.notice(line)
        raise
    loop.publish_leftovers()
    if loop.result is None and loop.exit_codes.get(0) == 0:
        return RunOutcome(None, dict(loop.exit_codes))
    return RunOutcome(loop.result, dict(loop.exit_codes))


def _raise_failure(loop: _Loop, group: RankGroup, relay: OutputRelay, data: DataPlane | None) -> NoReturn:
    """The first failure, with the failing process's last lines, once every rank and worker is stopped."""
    failure = _last_words(loop)
    relay.mute()
    group.stop()
    if data is not None:
        data.workers.stop()
    raise failure


def _last_words(loop: _Loop) -> RunError:
    """The failure, with what the failing process printed before it reported it."""
    assert loop.failure is not None
    loop.drain_pipes(loop.failure_peer)
    loop.relay.flush(force=True)
    loop.failure.last_lines = loop.relay.last_lines(loop.failure_peer)
    return loop.failure


def run_ranks(
    start: Callable[[int], RankGroup],
    server: RankServer,
    ids: PeerIds,
    greeting: Greeting,
    relay: OutputRelay,
    publish: Publish,
    timeout: float | None,
    data: Callable[[], DataPlane] | None = None,
    attempts: Attempts | None = None,
    explain: Explain | None = None,
    board: Board | None = None,
) -> RunOutcome:
    """Start the data workers (if any), then the ranks (``start(attempt)``), and supervise them;
    a failed attempt starts again as ``attempts`` allows (restarts.py). Whatever happens, no rank
    or worker outlives the call."""
    attempts = attempts or Attempts()
    plane = data() if data is not None else None
    loop = _Loop(ids, server, greeting, relay, publish, plane)
    loop.board = board
    try:
        loop.open()
        if plane is not None:
            plane.progress.show(force=True)
        if board is not None:
            board.start()
        previous: RunError | None = None
        for attempt in range(attempts.restarts + 1):
            group = start(attempt)
            try:
                loop.attach(group)
                loop.on_all_connected = functools.partial(attempts.running, attempt < attempts.restarts)
                outcome = _watch(loop, timeout, explain)
                if outcome is not None:
                    return outcome
                assert loop.failure is not None
                reason = refusal(attempt, attempts.restarts, loop.failure, previous)
                if reason is not None:
                    if reason:
                        loop.failure.notes = (*loop.failure.notes, f"taas: {reason}")
                    _raise_failure(loop, group, relay, plane)
                previous = _last_words(loop)
                group.stop(graceful=False)  # the next attempt starts from the checkpoint, not from their finally
            finally:
                loop.detach()
                group.close()
            attempts.between(attempt)  # only after a failed attempt (the last one returned or raised)
            for line in previous.notes:
                relay.notice(line)  # a timed-out attempt: where its ranks were
            relay.notice(restart_line(attempt, attempts.restarts, previous))
        raise AssertionError("unreachable: the last attempt returns or raises")
    finally:
        relay.flush(force=True)
        if board is not None:
            board.show(force=True)  # the last reports, drawn
        relay.finish()
        if plane is not None:
            plane.workers.close()  # before measuring the cache: nothing writes to it any more
            plane.progress.show(force=True, usage=plane.usage())
        loop.close()
