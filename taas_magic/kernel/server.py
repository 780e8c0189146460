"""The kernel's end of the rank channel: a loopback listener and authenticated connections.

Driven by the supervisor's selector loop, never blocking on a peer: a connection is
read only to complete the fixed-size handshake (wire.py) until it has proven the run's
key; a peer that fails is closed, having had nothing of it unpickled. Each rank may
connect once.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Iterable

from taas_magic import wire
from taas_magic.launch.rankenv import LOOPBACK


@dataclass
class PendingPeer:
    sock: socket.socket
    nonce: bytes
    received: bytearray = field(default_factory=bytearray)


@dataclass
class RankConnection:
    rank: int
    sock: socket.socket
    codec: wire.FrameCodec
    reader: wire.FrameReader

    def send(self, body: bytes) -> None:
        wire.send_blocking(self.sock, self.codec, body)


class RankServer:
    """Listens on 127.0.0.1 (the local mode; on the kernel's cluster address in the cluster
    mode, where other hosts' ranks connect); hands out connections that proved the key."""

    def __init__(self, key: bytes, world_size: int, host: str = LOOPBACK):
        self.key = key
        self.world_size = world_size
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind((host, 0))
        self.listener.listen(max(16, world_size))
        self.listener.setblocking(False)
        self.address = self.listener.getsockname()
        self.rejected = 0
        self._connected: set[int] = set()

    def accept(self) -> PendingPeer | None:
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return None
        sock.setblocking(False)
        nonce = wire.new_nonce()
        try:
            sock.send(nonce)
        except OSError:
            sock.close()
            return None
        return PendingPeer(sock, nonce)

    def read_hello(self, peer: PendingPeer) -> RankConnection | None | bool:
        """Advance a handshake: a connection, None (needs more bytes), or False (refused).

        A refused peer must be passed to :meth:`drop` (after the caller stops watching it).
        """
        try:
            chunk = peer.sock.recv(wire.HELLO_SIZE - len(peer.received))
        except BlockingIOError:
            return None
        except OSError:
            chunk = b""
        if not chunk:
            return False
        peer.received += chunk
        if len(peer.received) < wire.HELLO_SIZE:
            return None
        try:
            rank = wire.check_hello(self.key, peer.nonce, bytes(peer.received))
        except wire.AuthenticationError:
            return False
        if not 0 <= rank < self.world_size or rank in self._connected:
            return False
        self._connected.add(rank)
        peer.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        codec = wire.FrameCodec(self.key, peer.nonce, outgoing=wire.KERNEL_TO_RANK, incoming=wire.RANK_TO_KERNEL)
        return RankConnection(rank, peer.sock, codec, wire.FrameReader(codec))

    def readmit(self, ids: Iterable[int]) -> None:
        """Those peers were restarted: their new processes may connect (and prove the key) again."""
        self._connected.difference_update(ids)

    def drop(self, peer: PendingPeer) -> None:
        self.rejected += 1
        peer.sock.close()

    def close(self) -> None:
        self.listener.close()
