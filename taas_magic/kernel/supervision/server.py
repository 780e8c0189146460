"""The kernel's end of the rank channel: a loopback listener and authenticated connections.

Runs in the kernel: the listener is opened in the run's plan step (kernel/runs/run.py), and its
connections are driven on the run's own thread by the supervisor's selector loop.

Driven by the supervisor's selector loop, never blocking on a peer: a connection is
read only to complete the fixed-size handshake (wire.py) until it has proven the run's
key; a peer that fails is closed, having had nothing of it unpickled. Each rank may
connect once.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Iterable

from taas_magic import wire

PendingPeer = wire.Hello  # a connection that has not yet proven the run's key


@dataclass
class PeerConnection:
    peer_id: int  # the id it proved in its hello (peers.PeerIds says whose)
    sock: socket.socket
    codec: wire.FrameCodec
    reader: wire.FrameReader

    def send(self, body: bytes) -> None:
        wire.send_blocking(self.sock, self.codec, body)


class PeerServer:
    """Listens on 127.0.0.1 (the local mode; on the kernel's cluster address in the cluster
    mode, where other hosts' ranks connect); hands out connections that proved the key."""

    def __init__(self, key: bytes, world_size: int, host: str = wire.LOOPBACK):
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
        try:
            return wire.Hello.greet(sock)
        except OSError:
            sock.close()
            return None

    def read_hello(self, peer: PendingPeer) -> PeerConnection | None | bool:
        """Advance a handshake: a connection, None (needs more bytes), or False (refused).

        A refused peer must be passed to :meth:`drop` (after the caller stops watching it).
        """
        try:
            peer_id = peer.read(self.key, lambda claimed: 0 <= claimed < self.world_size and claimed not in self._connected)
        except (OSError, wire.AuthenticationError):
            return False
        if peer_id is None:
            return None
        self._connected.add(peer_id)
        codec = wire.FrameCodec(self.key, peer.nonce, outgoing=wire.KERNEL_TO_RANK, incoming=wire.RANK_TO_KERNEL)
        return PeerConnection(peer_id, peer.sock, codec, wire.FrameReader(codec))

    def readmit(self, ids: Iterable[int]) -> None:
        """Those peers were restarted: their new processes may connect (and prove the key) again."""
        self._connected.difference_update(ids)

    def drop(self, peer: PendingPeer) -> None:
        self.rejected += 1
        peer.sock.close()

    def close(self) -> None:
        self.listener.close()
