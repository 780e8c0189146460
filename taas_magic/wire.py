"""Framed, HMAC-signed messages between the kernel and its ranks; the loopback address and the port
reservation every launcher holds for rank 0's store (:class:`PortReservation`).

Runs in every process at either end of a channel: the kernel (a run's own thread reads and writes
its frames), each rank, spare and data worker (rank/startup.py connects), and a Ray host agent or
Slurm task (its channels to the kernel's output hub).

IMPORTANT: nothing read from a socket is unpickled before it is authenticated.

Handshake (the peer connects, the kernel listens: on loopback in the local mode)::

    kernel -> peer : nonce (32 random bytes, fresh per connection)
    peer -> kernel : HMAC(key, "taas-hello" | nonce | id) | id (4 bytes)

The kernel checks the MAC with ``hmac.compare_digest`` and drops the connection on
any mismatch, having read a fixed 36 bytes and unpickled nothing. This one pair,
:func:`connect` and :class:`Hello` (or :func:`accept` where blocking is fine), serves every
listener of a run: the rank server (ranks and data workers, ids from ``peers.PeerIds``)
and the cluster's output hub (the agents' output and control channels, ids from
``peers.HubChannels``).

Frames, both directions::

    length (8 bytes) | HMAC(key, direction | nonce | seq | body) (32 bytes) | body

``direction`` stops a frame being reflected back to its sender, ``nonce`` stops it
being replayed on another connection, ``seq`` stops replay or reordering on this one.
``body`` is ``kind_len (1) | kind (ascii) | data``. A frame that fails verification
raises :class:`AuthenticationError`; its body is never decoded.

The per-run key reaches a rank on its stdin, never in its environment (which the
cell's own subprocesses inherit).
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import pickle
import secrets
import select
import socket
import struct
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable

LOOPBACK = "127.0.0.1"  # where local-mode sockets listen, and rank 0's store in the local mode


TRIES = 5  # ports tried for one free on both families


class PortReservation:
    """A free TCP port for MASTER_PORT, held for the run on every address of both families.

    Its sockets are bound with SO_REUSEADDR but never listen: torch's TCPStore, which also sets
    SO_REUSEADDR, can still bind the port, yet no other socket is given it, so two notebooks (or a
    gloo listener, a Ray or Slurm daemon) launching at once cannot clash. Held on loopback only, it
    was not enough: a socket binding port 0 on the host's other address (192.0.2.2, fd00::2, ::1)
    could be handed the same port, listen there, and rank 0's store then failed with EADDRINUSE
    (tests/unit/test_rankenv.py). Close it when the run ends.
    """

    def __init__(self) -> None:
        for _ in range(TRIES):
            self._sockets = [_reserving(socket.AF_INET, "", 0)]
            self.port: int = self._sockets[0].getsockname()[1]
            if not socket.has_ipv6:
                return
            try:
                self._sockets.append(_reserving(socket.AF_INET6, "::", self.port))
                return
            except OSError as refused:
                if refused.errno != errno.EADDRINUSE:
                    return  # no IPv6 on this host: nothing can take the port there either
                self.close()  # an IPv6 socket has this port already: another one
        raise OSError(errno.EADDRINUSE, f"no port free on both IPv4 and IPv6 in {TRIES} tries")

    @property
    def closed(self) -> bool:
        return self._sockets[0].fileno() == -1

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


def _reserving(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


KEY_SIZE = 32
NONCE_SIZE = 32
MAC_SIZE = 32
RANK = struct.Struct("!I")
LENGTH = struct.Struct("!Q")
HELLO_SIZE = MAC_SIZE + RANK.size
KERNEL_TO_RANK = b"k>r"
RANK_TO_KERNEL = b"r>k"


@dataclass(frozen=True)
class Handshake:
    """Where the kernel listens and the run's key: the one line a process the kernel starts
    reads on its stdin (rank/startup.py), never in its environment; and, given to a cluster
    host's agent, where the kernel's output hub listens (launch/hosts/agent.py)."""

    host: str
    port: int
    key: bytes

    def line(self) -> str:
        return f"{self.host} {self.port} {self.key.hex()}"

    @classmethod
    def parse(cls, line: str) -> "Handshake":
        host, port, key_hex = line.split()
        return cls(host, int(port), bytes.fromhex(key_hex))


@dataclass(frozen=True)
class Placement:
    """Who one started process is: its id on the wire, the name its messages use, and, where
    the write rule isolates it, its scratch layer over the repository. The line after the
    handshake on its stdin (after a spare's settings): run data never rides in the
    environment, which the cell's own subprocesses inherit and read."""

    peer_id: int
    who: str  # "rank 1", "data worker 0"
    repository: str | None = None
    layer: str | None = None  # its private scratch layer: writes under the repository land here
    write_mode: str | None = None  # "overlay" or "python" (writes/rule.py)
    marker: str | None = None  # a cluster run's marker in the repository: a host that does not see it is away (writes/away.py)
    away: str | None = None  # set by an away host's agent: the notebook's repository, where this rank's files are sent

    def line(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, line: str) -> "Placement":
        return cls(**json.loads(line))


class AuthenticationError(ConnectionError):
    """A peer could not prove it holds the run's key; nothing it sent was unpickled."""


def new_key() -> bytes:
    return secrets.token_bytes(KEY_SIZE)


def hello_mac(key: bytes, nonce: bytes, peer_id: int) -> bytes:
    return hmac.new(key, b"taas-hello" + nonce + RANK.pack(peer_id), hashlib.sha256).digest()


def check_hello(key: bytes, nonce: bytes, hello: bytes) -> int:
    """Return the id a hello claims, or raise AuthenticationError."""
    if len(hello) != HELLO_SIZE:
        raise AuthenticationError("short handshake")
    mac, id_bytes = hello[:MAC_SIZE], hello[MAC_SIZE:]
    (peer_id,) = RANK.unpack(id_bytes)
    if not hmac.compare_digest(mac, hello_mac(key, nonce, peer_id)):
        raise AuthenticationError("handshake MAC mismatch")
    return peer_id


def connect(address: tuple[str, int], key: bytes, peer_id: int, timeout: float | None = None) -> tuple[socket.socket, bytes]:
    """The peer's end of the hello: connect, read the listener's nonce, prove the key for
    ``peer_id``. Returns the blocking socket (TCP_NODELAY) and the nonce its frames are signed under."""
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = _recv_exactly(sock, NONCE_SIZE)
        sock.sendall(hello_mac(key, nonce, peer_id) + RANK.pack(peer_id))
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock, nonce


@dataclass
class Hello:
    """The listener's end of one connection's hello, read as its bytes arrive, never blocking.

    :meth:`greet` sends the nonce; :meth:`read` takes what has arrived: the id the peer
    proved (``valid`` must accept it too), None while bytes are missing, or
    AuthenticationError (or OSError), after which the caller closes the socket.
    """

    sock: socket.socket
    nonce: bytes
    received: bytearray

    @classmethod
    def greet(cls, sock: socket.socket) -> "Hello":
        nonce = new_nonce()
        sock.send(nonce)  # 32 bytes into an empty socket buffer: never partial
        return cls(sock, nonce, bytearray())

    def read(self, key: bytes, valid: Callable[[int], bool]) -> int | None:
        try:
            chunk = self.sock.recv(HELLO_SIZE - len(self.received))
        except BlockingIOError:  # a non-blocking socket with nothing yet; a blocking one's timeout is an OSError
            return None
        if not chunk:
            raise ConnectionError("the peer closed the connection during the handshake")
        self.received += chunk
        if len(self.received) < HELLO_SIZE:
            return None
        peer_id = check_hello(key, self.nonce, bytes(self.received))
        if not valid(peer_id):
            raise AuthenticationError(f"unknown or repeated peer id {peer_id}")
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return peer_id


def accept(listener: socket.socket, key: bytes, valid: Callable[[int], bool], timeout: float) -> tuple[socket.socket, int] | None:
    """Accept one connection and read its hello, blocking at most ``timeout``: the socket
    (blocking) and the id it proved, or None (the connection was closed: it failed the hello)."""
    sock, _ = listener.accept()
    sock.settimeout(timeout)
    try:
        hello = Hello.greet(sock)
        while (peer_id := hello.read(key, valid)) is None:
            pass
    except (OSError, AuthenticationError):
        sock.close()
        return None
    sock.settimeout(None)
    return sock, peer_id


def encode_body(kind: str, data: bytes) -> bytes:
    kind_bytes = kind.encode("ascii")
    return bytes([len(kind_bytes)]) + kind_bytes + data


def decode_body(body: bytes | memoryview) -> tuple[str, memoryview]:
    view = memoryview(body)
    size = view[0]
    return bytes(view[1 : 1 + size]).decode("ascii"), view[1 + size :]


class FrameCodec:
    """Signs outgoing and verifies incoming frames of one connection."""

    def __init__(self, key: bytes, nonce: bytes, *, outgoing: bytes, incoming: bytes):
        self._key = key
        self._nonce = nonce
        self._outgoing = outgoing
        self._incoming = incoming
        self._send_seq = 0
        self._recv_seq = 0

    def _mac(self, direction: bytes, seq: int, body: bytes | memoryview) -> bytes:
        mac = hmac.new(self._key, direction + self._nonce + LENGTH.pack(seq), hashlib.sha256)
        mac.update(body)
        return mac.digest()

    def header(self, body: bytes | memoryview) -> bytes:
        mac = self._mac(self._outgoing, self._send_seq, body)
        self._send_seq += 1
        return LENGTH.pack(len(body)) + mac

    def verify(self, mac: bytes, body: bytes | memoryview) -> None:
        expected = self._mac(self._incoming, self._recv_seq, body)
        if not hmac.compare_digest(mac, expected):
            raise AuthenticationError("frame MAC mismatch: forged, replayed or reordered frame")
        self._recv_seq += 1


class FrameReader:
    """Incremental frame parser for non-blocking reads: feed bytes, get verified frames."""

    def __init__(self, codec: FrameCodec):
        self._codec = codec
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[str, memoryview]]:
        self._buffer += data
        frames = []
        head = LENGTH.size + MAC_SIZE
        while len(self._buffer) >= head:
            (length,) = LENGTH.unpack_from(self._buffer)
            if len(self._buffer) < head + length:
                break
            mac = bytes(self._buffer[LENGTH.size : head])
            body = bytes(self._buffer[head : head + length])
            del self._buffer[: head + length]
            self._codec.verify(mac, body)
            frames.append(decode_body(body))
        return frames


def dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def loads_verified(data: bytes | memoryview) -> Any:
    """Unpickle a body that a FrameCodec has already verified."""
    return pickle.loads(data)  # noqa: S301 - only ever given a body whose frame MAC was verified


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(min(size - len(chunks), 1 << 20))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        chunks += chunk
    return bytes(chunks)


class BlockingChannel:
    """The rank's end: a blocking socket that sends and receives verified frames."""

    def __init__(self, sock: socket.socket, codec: FrameCodec):
        self._sock = sock
        self._codec = codec
        self._send_lock = threading.Lock()  # the cell may display() from its own threads

    @classmethod
    def connect(cls, host: str, port: int, key: bytes, peer_id: int) -> "BlockingChannel":
        sock, nonce = connect((host, port), key, peer_id)
        return cls(sock, FrameCodec(key, nonce, outgoing=RANK_TO_KERNEL, incoming=KERNEL_TO_RANK))

    def send(self, kind: str, data: bytes) -> None:
        with self._send_lock:
            write_frame(self._sock, self._codec, encode_body(kind, data))

    def recv(self) -> tuple[str, memoryview]:
        head = _recv_exactly(self._sock, LENGTH.size + MAC_SIZE)
        (length,) = LENGTH.unpack_from(head)
        body = _recv_exactly(self._sock, length)
        self._codec.verify(head[LENGTH.size :], body)
        return decode_body(body)

    def readable(self, timeout: float | None) -> bool:
        """Whether a frame has begun to arrive (waits up to ``timeout``; None: forever)."""
        ready, _, _ = select.select([self._sock], [], [], timeout)
        return bool(ready)

    def close(self) -> None:
        self._sock.close()


SMALL_FRAME = 1 << 16  # a body this small is sent with its header in one write


def _frame_parts(codec: FrameCodec, body: bytes) -> list[bytes]:
    """The signed frame of one encoded body, as the writes that send it: one for a small frame; a large
    closure is not copied to prepend its header."""
    header = codec.header(body)
    return [header + body] if len(body) <= SMALL_FRAME else [header, body]


def write_frame(sock: socket.socket, codec: FrameCodec, body: bytes) -> None:
    """Sign and send one encoded body (see encode_body) on a blocking socket."""
    for part in _frame_parts(codec, body):
        sock.sendall(part)


def send_blocking(sock: socket.socket, codec: FrameCodec, body: bytes) -> None:
    """Send one encoded body on a socket that is otherwise read without blocking: a small frame, which the
    socket's buffer almost always takes whole, in one non-blocking write; the rest blocking."""
    parts = _frame_parts(codec, body)
    if len(parts) == 1:
        try:
            sent = sock.send(parts[0])
        except BlockingIOError:
            sent = 0
        if sent == len(parts[0]):
            return
        parts = [parts[0][sent:]]
    sock.setblocking(True)
    try:
        for part in parts:
            sock.sendall(part)
    finally:
        sock.setblocking(False)


def new_nonce() -> bytes:
    return os.urandom(NONCE_SIZE)
