"""The supervisor's I/O: one selector over everything a run's processes say, turned into typed events.

Runs in the kernel, on the run's own thread with the supervisor (supervisor.py), and decides nothing: no failure, no
retry, no routing. What it watches: the rank server's listener and the handshakes in
progress (kernel/supervision/server.py), each process's stdout and stderr pipes, each connected peer's
authenticated channel (wire.py, frames decoded by protocol.py), and each process's exit (a
pidfd where the launcher gives one, so an exit wakes the selector; else ``poll()``).

Events, each a frozen dataclass::

    PeerConnected(peer)           it proved the key; it was sent its greeting, then what was queued for it
    Output(peer, stream, data)    bytes from its stdout or stderr pipe
    OutputEnded(peer, stream)     that pipe closed
    FrameArrived(peer, frame)     a verified frame (protocol.ToKernel)
    FrameRefused(peer, why)       a frame failed authentication or decoding; its channel is closed
    PeerExited(peer, code)        the process ended (negative: killed by that signal)

Guarantees the supervisor builds on: a process's exit comes after every frame it sent
before it (its channel is drained first: its error report is read before its death is
judged); a frame for a peer not connected yet waits and goes after its greeting, and one
for a peer that exited is dropped; draining a pipe stops after ``DRAIN_READS`` reads (a
child the process left may still hold the pipe and write). The methods that return events
are generators: the caller handles each event before the next is read, so a handler may
call back in (the relay's display marker drains the channel that carries the display).
"""

from __future__ import annotations

import os
import select
import selectors
import socket
from dataclasses import dataclass
from typing import Callable, Iterator

from taas_magic import protocol, wire
from taas_magic.kernel.supervision.server import PeerConnection, PeerServer, PendingPeer
from taas_magic.launch.contract import ChildProcess
from taas_magic.peers import Peer, PeerIds
from taas_magic.protocol import ToKernel

DRAIN_READS = 256  # at most this many reads of a pipe being drained (a leftover child may still write)

Greeting = Callable[[Peer], list[bytes]]  # the encoded frames a peer gets once connected


@dataclass(frozen=True)
class PeerConnected:
    peer: Peer


@dataclass(frozen=True)
class Output:
    peer: Peer
    stream: str  # "stdout" or "stderr"
    data: bytes


@dataclass(frozen=True)
class OutputEnded:
    peer: Peer
    stream: str


@dataclass(frozen=True)
class FrameArrived:
    peer: Peer
    frame: ToKernel


@dataclass(frozen=True)
class FrameRefused:
    peer: Peer
    why: str  # "sent a frame that failed authentication (...)", as the cell's error says it


@dataclass(frozen=True)
class PeerExited:
    peer: Peer
    code: int


Event = PeerConnected | Output | OutputEnded | FrameArrived | FrameRefused | PeerExited


class _Channels:
    """The listener, the handshakes in progress and the connected peers' channels."""

    def __init__(self, selector: selectors.BaseSelector, server: PeerServer, ids: PeerIds, greeting: Greeting):
        self.selector, self.server, self.ids, self.greeting = selector, server, ids, greeting
        self.connections: dict[Peer, PeerConnection] = {}
        self.queued: dict[Peer, list[bytes]] = {}  # frames for peers not connected yet
        selector.register(server.listener, selectors.EVENT_READ, ("listen", None))

    def accept(self) -> None:
        pending = self.server.accept()
        if pending is not None:
            self.selector.register(pending.sock, selectors.EVENT_READ, ("hello", pending))

    def hello(self, pending: PendingPeer) -> Iterator[Event]:
        outcome = self.server.read_hello(pending)
        if outcome is None:
            return
        self.selector.unregister(pending.sock)
        if not isinstance(outcome, PeerConnection):
            self.server.drop(pending)
            return
        peer = self.ids.peer(outcome.peer_id)  # the number it proved in its hello
        self.connections[peer] = outcome
        for body in self.greeting(peer) + self.queued.pop(peer, []):
            outcome.send(body)
        self.selector.register(outcome.sock, selectors.EVENT_READ, ("conn", outcome))
        yield PeerConnected(peer)

    def read(self, connection: PeerConnection) -> Iterator[Event]:
        try:
            data = connection.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.close(connection)
            return
        peer = self.ids.peer(connection.peer_id)
        try:
            frames = [protocol.decode(kind, body, ToKernel) for kind, body in connection.reader.feed(data)]
        except wire.AuthenticationError as exc:
            self.close(connection)
            yield FrameRefused(peer, f"sent a frame that failed authentication ({exc})")
            return
        except protocol.ProtocolError as exc:
            self.close(connection)
            yield FrameRefused(peer, f"sent a frame the kernel does not understand ({exc})")
            return
        yield from (FrameArrived(peer, frame) for frame in frames)

    def drain(self, peer: Peer) -> Iterator[Event]:
        """Every frame the peer sent that is still buffered (say, its error report before it died)."""
        connection = self.connections.get(peer)
        while connection is not None and peer in self.connections:
            try:
                connection.sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return  # nothing buffered, and the process is gone: nothing more will come
            except OSError:
                pass
            yield from self.read(connection)

    def send(self, peer: Peer, body: bytes) -> bool:
        """Send ``body`` to ``peer`` if it is connected (False if it is not)."""
        connection = self.connections.get(peer)
        if connection is None:
            return False
        try:
            connection.send(body)
        except OSError:
            pass  # it has exited; its exit code tells the rest
        return True

    def close(self, connection: PeerConnection) -> None:
        self.selector.unregister(connection.sock)
        connection.sock.close()
        self.connections.pop(self.ids.peer(connection.peer_id), None)

    def close_all(self) -> None:
        for connection in self.connections.values():
            connection.sock.close()
        for key in list(self.selector.get_map().values()):
            if key.data[0] == "hello":
                key.data[1].sock.close()


class Mux:
    """One run's selector: watch processes, read what they say as events, send them frames."""

    def __init__(self, server: PeerServer, ids: PeerIds, greeting: Greeting):
        self.selector = selectors.DefaultSelector()
        self.channels = _Channels(self.selector, server, ids, greeting)
        self.processes: dict[Peer, ChildProcess] = {}  # watched, not yet seen to exit
        self.pipes: dict[int, tuple[Peer, str]] = {}  # fd -> (peer, stream)
        self.exit_fds: dict[Peer, int] = {}  # the pidfds, registered until they fire or the rank is forgotten
        self.exited: set[Peer] = set()
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.selector.register(self._wake_read, selectors.EVENT_READ, ("wake", None))

    def wake(self) -> None:
        """From another thread: the select under way returns now (a person's answer is waiting to be sent)."""
        if self._wake_write < 0:
            return  # closed: the run is over
        try:
            os.write(self._wake_write, b"!")
        except (BlockingIOError, OSError):
            pass  # already woken (the pipe is full), or closed: the run is over

    def watch(self, peer: Peer, process: ChildProcess) -> None:
        """Watch ``process`` as ``peer``: its pipes and exit, once (kept ranks are attached to each of their cells)."""
        if self.processes.get(peer) is process:
            return
        self.processes[peer] = process
        for name, fd in (("stdout", process.stdout_fd), ("stderr", process.stderr_fd)):
            os.set_blocking(fd, False)
            self.pipes[fd] = (peer, name)
            self.selector.register(fd, selectors.EVENT_READ, ("pipe", fd))
        if process.exit_fd is not None:
            self.exit_fds[peer] = process.exit_fd
            self.selector.register(process.exit_fd, selectors.EVENT_READ, ("exit", process.exit_fd))

    def events(self, timeout: float) -> Iterator[Event]:
        """What arrived within ``timeout`` seconds (exits: :meth:`exits`)."""
        for key, _ in self.selector.select(timeout):
            if not self._still_watched(key):
                continue  # unregistered by a handler of an earlier event of this select
            tag, item = key.data
            if tag == "listen":
                self.channels.accept()
            elif tag == "hello":
                yield from self.channels.hello(item)
            elif tag == "pipe":
                yield from self._read_pipe(item)
            elif tag == "conn":
                yield from self.channels.read(item)
            elif tag == "exit":  # a process ended: exits() reads its code
                self.selector.unregister(item)
            elif tag == "wake":
                while _read_some(self._wake_read):
                    pass

    def _still_watched(self, key: selectors.SelectorKey) -> bool:
        try:
            return self.selector.get_map()[key.fileobj] is key
        except (KeyError, ValueError):  # ValueError: a socket closed since (its fileno is -1)
            return False

    def exits(self) -> Iterator[Event]:
        """The processes that ended since the last call (ranks first), each after its last frames."""
        for peer in sorted(self.processes, key=lambda peer: not peer.is_rank):
            code = self.processes[peer].poll()
            if code is not None:
                del self.processes[peer]
                self.exited.add(peer)
                yield from self.channels.drain(peer)
                yield PeerExited(peer, code)

    def _read_pipe(self, fd: int) -> Iterator[Event]:
        peer, name = self.pipes[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if data:
            yield Output(peer, name, data)
            return
        self.selector.unregister(fd)
        del self.pipes[fd]
        yield OutputEnded(peer, name)

    def drain_pipes(self, peer: Peer) -> Iterator[Event]:
        """What the process printed and is still in its pipes (bounded, see the module's docstring)."""
        for fd, (owner, _) in list(self.pipes.items()):
            if owner == peer:
                for _ in range(DRAIN_READS):
                    if fd not in self.pipes or not select.select([fd], [], [], 0)[0]:
                        break
                    yield from self._read_pipe(fd)

    def send(self, peer: Peer, body: bytes) -> bool:
        return self.channels.send(peer, body)

    def deliver(self, peer: Peer, body: bytes) -> None:
        """Send now, or once the peer connects; never to one that exited."""
        if not self.send(peer, body) and peer not in self.exited:
            self.channels.queued.setdefault(peer, []).append(body)

    def connected_ranks(self) -> int:
        return sum(peer.is_rank for peer in self.channels.connections)

    def exited_connected(self, peer: Peer) -> bool:
        """Whether ``peer`` exited and its channel is still open (its last frames may still be on their way)."""
        return peer in self.exited and peer in self.channels.connections

    def forget_ranks(self) -> Iterator[Event]:
        """After an attempt's ranks were stopped: what they printed last and the end of their output;
        then they are forgotten (the workers stay), so the next attempt's ranks are new processes."""
        for peer in {peer for peer, _ in self.pipes.values() if peer.is_rank}:
            yield from self.drain_pipes(peer)
        for fd, (peer, stream) in list(self.pipes.items()):
            if peer.is_rank:
                self.selector.unregister(fd)
                del self.pipes[fd]
                yield OutputEnded(peer, stream)
        self.forget(lambda peer: peer.is_rank)
        self.channels.server.readmit(range(self.channels.ids.ranks))

    def forget(self, which: Callable[[Peer], bool]) -> None:
        """Stop watching the peers ``which`` picks: their pipes, exits, processes and channels (a kept cell's data
        workers after it, stopped with it; a kept rank that died, as a new process takes its place: keptcell.py)."""
        watched = self.selector.get_map()
        for fd, (peer, _) in list(self.pipes.items()):
            if which(peer):
                self.selector.unregister(fd)
                del self.pipes[fd]
        for peer in [peer for peer in self.exit_fds if which(peer)]:
            fd = self.exit_fds.pop(peer)
            if fd in watched:  # its exit had not woken the selector yet
                self.selector.unregister(fd)
        self.processes = {peer: process for peer, process in self.processes.items() if not which(peer)}
        for peer, connection in list(self.channels.connections.items()):
            if which(peer):
                self.channels.close(connection)
        self.exited = {peer for peer in self.exited if not which(peer)}
        self.channels.queued = {peer: bodies for peer, bodies in self.channels.queued.items() if not which(peer)}

    def close(self) -> None:
        self.channels.close_all()
        self.selector.close()
        wake_read, wake_write, self._wake_read, self._wake_write = self._wake_read, self._wake_write, -1, -1
        os.close(wake_read)
        os.close(wake_write)


def _read_some(fd: int) -> bool:
    try:
        return bool(os.read(fd, 4096))
    except BlockingIOError:
        return False
