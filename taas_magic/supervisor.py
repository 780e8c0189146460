"""The run loop: start, feed, watch and always reap the ranks of one cell.

It runs in the kernel's main thread, inside the magic, and installs no signal handler:
the kernel's interrupt arrives here as ``KeyboardInterrupt``, and the ``finally`` of
:func:`run_ranks` stops every rank. One selector watches everything, so there are no
threads to race: the listener, handshakes, rank channels (rich output, errors, rank
0's results) and the ranks' stdout/stderr pipes. Because a rank flushes its pipes
before it sends a display message, draining that rank's pipes before publishing the
message keeps text and rich output in the order the rank produced them.

The first failure (an error frame, or a non-zero exit) stops every rank; the cell's
error names that rank. ``--timeout`` stops every rank and names those still running.
"""

from __future__ import annotations

import os
import select
import selectors
import socket
import time
from dataclasses import dataclass
from typing import Callable

from . import wire
from .errors import RankFailed, RunTimeout, describe_exit
from .launch.base import RankGroup
from .relay import OutputRelay
from .server import PendingPeer, RankConnection, RankServer

POLL_SECONDS = 0.05
PIPE_GRACE_SECONDS = 2.0  # after every rank exited, how long to wait for pipes to close

Publish = Callable[[str, dict], None]


@dataclass
class RunOutcome:
    result: dict | None  # rank 0's "result" message; None if rank 0 ended with sys.exit(0)
    exit_codes: dict[int, int]


class _Loop:
    def __init__(self, group: RankGroup, server: RankServer, bodies: list[bytes], relay: OutputRelay, publish: Publish):
        self.group = group
        self.server = server
        self.bodies = bodies
        self.relay = relay
        self.publish = publish
        self.selector = selectors.DefaultSelector()
        self.pipes: dict[int, tuple[int, str]] = {}
        self.connections: dict[int, RankConnection] = {}
        self.exit_codes: dict[int, int] = {}
        self.failure: RankFailed | None = None
        self.result: dict | None = None
        self.displays: dict[tuple[int, int], tuple[str, dict]] = {}
        relay.on_marker = self.on_marker

    # -- registration -----------------------------------------------------------------
    def open(self) -> None:
        self.selector.register(self.server.listener, selectors.EVENT_READ, ("listen", None))
        for rank in self.group.ranks:
            for name, fd in (("stdout", rank.stdout_fd), ("stderr", rank.stderr_fd)):
                os.set_blocking(fd, False)
                self.pipes[fd] = (rank.rank, name)
                self.selector.register(fd, selectors.EVENT_READ, ("pipe", fd))

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
                peer = self.server.accept()
                if peer is not None:
                    self.selector.register(peer.sock, selectors.EVENT_READ, ("hello", peer))
            elif tag == "hello":
                self._on_hello(item)
            elif tag == "pipe":
                self._read_pipe(item)
            elif tag == "conn":
                self._read_connection(item)

    def _on_hello(self, peer: PendingPeer) -> None:
        outcome = self.server.read_hello(peer)
        if outcome is None:
            return
        self.selector.unregister(peer.sock)
        if outcome is False:
            self.server.drop(peer)
            return
        connection: RankConnection = outcome  # type: ignore[assignment]
        self.connections[connection.rank] = connection
        for body in self.bodies:
            connection.send(body)
        self.selector.register(connection.sock, selectors.EVENT_READ, ("conn", connection))

    def _read_pipe(self, fd: int) -> None:
        rank, name = self.pipes[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if data:
            self.relay.feed(rank, name, data)
            return
        self.relay.end_of_stream(rank, name)
        self.selector.unregister(fd)
        del self.pipes[fd]

    def drain_pipes(self, rank: int) -> None:
        for fd, (owner, _) in list(self.pipes.items()):
            if owner == rank:
                while fd in self.pipes and self._pipe_has_data(fd):
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
        try:
            frames = connection.reader.feed(data)
        except wire.AuthenticationError as exc:
            self._close_connection(connection)
            self._fail(RankFailed(connection.rank, self._host(connection.rank), f"sent a frame that failed authentication ({exc})"))
            return
        for kind, body in frames:
            self._on_frame(connection.rank, kind, body)

    def drain_connection(self, rank: int) -> None:
        """Read every frame a rank sent before it exited (its error report, say)."""
        connection = self.connections.get(rank)
        while connection is not None and rank in self.connections:
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
        self.connections.pop(connection.rank, None)

    def _on_frame(self, rank: int, kind: str, body: memoryview) -> None:
        message = wire.loads_verified(body)
        if kind in ("display", "clear_output"):
            self.displays[(rank, message["number"])] = (kind, message)
        elif kind == "error":
            self._fail(RankFailed(rank, self._host(rank), message["summary"], message["traceback"]))
        elif kind == "result" and rank == 0:
            self.result = message

    def on_marker(self, rank: int, number: int) -> None:
        """A rank's display ``number`` belongs here in its text: publish it now."""
        if (rank, number) not in self.displays:
            self.drain_connection(rank)  # sent before the marker was written: it is buffered
        shown = self.displays.pop((rank, number), None)
        if shown is not None and self.relay.shows(rank):
            self.relay.flush(force=True)
            self.publish(*shown)

    def publish_leftovers(self) -> None:
        """Displays whose marker never came (the cell closed fd 1): show them last."""
        for key in sorted(self.displays):
            if self.relay.shows(key[0]):
                self.relay.flush(force=True)
                self.publish(*self.displays[key])
        self.displays.clear()

    def _fail(self, failure: RankFailed) -> None:
        if self.failure is None:  # the root cause is the first failure
            self.failure = failure

    def _host(self, rank: int) -> str:
        return self.group.ranks[rank].host

    def poll_exits(self) -> None:
        for rank in self.group.ranks:
            if rank.rank in self.exit_codes:
                continue
            code = rank.poll()
            if code is None:
                continue
            self.exit_codes[rank.rank] = code
            if code != 0:
                self.drain_connection(rank.rank)  # its error frame may still be unread
                self._fail(RankFailed(rank.rank, rank.host, describe_exit(code) + " without reporting an error"))

    def finished(self) -> bool:
        return len(self.exit_codes) == len(self.group.ranks) and not self.pipes and not self.connections


def supervise(
    group: RankGroup,
    server: RankServer,
    bodies: list[bytes],
    relay: OutputRelay,
    publish: Publish,
    timeout: float | None,
) -> RunOutcome:
    """Watch the ranks until all finish, one fails, or the timeout passes."""
    loop = _Loop(group, server, bodies, relay, publish)
    loop.open()
    deadline = None if timeout is None else time.monotonic() + timeout
    all_exited_at: float | None = None
    try:
        while True:
            now = time.monotonic()
            wait = min(POLL_SECONDS, relay.seconds_until_flush(now))
            if deadline is not None:
                wait = min(wait, max(0.0, deadline - now))
            loop.step(wait)
            loop.poll_exits()
            relay.flush()
            if loop.failure is not None:
                break
            if loop.finished():
                break
            now = time.monotonic()
            if len(loop.exit_codes) == len(group.ranks):
                all_exited_at = all_exited_at or now
                if now - all_exited_at > PIPE_GRACE_SECONDS:
                    break  # something the cell started still holds a pipe open: group.close() ends it
            if deadline is not None and now >= deadline:
                running = tuple(r.rank for r in group.ranks if r.rank not in loop.exit_codes)
                group.stop()
                raise RunTimeout(timeout, running)  # type: ignore[arg-type]
        if loop.failure is not None:
            failure = loop.failure
            loop.drain_pipes(failure.rank)  # what it printed before it reported the failure
            relay.flush(force=True)
            last_lines = relay.last_lines(failure.rank)
            relay.mute()
            group.stop()
            raise RankFailed(failure.rank, failure.host, failure.summary, failure.traceback_text, last_lines)
        loop.publish_leftovers()
        if loop.result is None and loop.exit_codes.get(0) == 0:
            return RunOutcome(None, dict(loop.exit_codes))
        return RunOutcome(loop.result, dict(loop.exit_codes))
    finally:
        relay.flush(force=True)
        loop.close()


def run_ranks(
    start: Callable[[], RankGroup],
    server: RankServer,
    bodies: list[bytes],
    relay: OutputRelay,
    publish: Publish,
    timeout: float | None,
) -> RunOutcome:
    """Start the ranks and supervise them; whatever happens, no rank outlives the call."""
    group = start()
    try:
        return supervise(group, server, bodies, relay, publish, timeout)
    finally:
        group.close()

