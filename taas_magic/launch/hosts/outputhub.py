"""The kernel's end of each host's channels: the hub the hosts' output and control channels connect to.

Runs in the kernel, on the run's own thread: made as an attempt's ranks start, read by the
supervisor's selector as it reads local pipes.

Both cluster engines use it: each host's Ray agent (launch/hosts/agent.py through launch/ray/processes.py) and
each Slurm task (launch/slurm/step.py) connects its ranks' output channels and one control
channel here, proving the run's key before the kernel reads a byte. A control channel carries
the host's ranks' exit codes as ``INDEX CODE`` lines (:class:`HostControl`).
"""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from taas_magic import wire
from taas_magic.errors import LaunchError


class OutputHub:
    """The kernel's listener for the agents' output and control channels.

    Listens on the kernel host's cluster address (the ranks' hosts must reach it); a
    connection counts only once it has proven the run's key for a channel not yet taken.
    """

    def __init__(self, address: str, key: bytes, channels: int):
        self.key = key
        self.channels = channels
        self.listener = socket.create_server((address, 0))
        self.address = self.listener.getsockname()[:2]
        self.connected: dict[int, socket.socket] = {}

    @property
    def handshake(self) -> wire.Handshake:
        """Where the hub listens and the run's key: what each host's agent connects with (launch/hosts/agent.py)."""
        return wire.Handshake(self.address[0], self.address[1], self.key)

    def collect(self, deadline: float, starting: list, ray: Any) -> None:
        """Ray's: accept until every channel has connected; fail if an agent's start fails or the deadline passes."""
        def started() -> None:
            done, starting[:] = ray.wait(starting, timeout=0, num_returns=len(starting)) if starting else ([], [])
            for ref in done:
                ray.get(ref)  # raises the agent's own error if its start failed

        self.accept(deadline, range(self.channels), started, lambda missing: (
            f"taas: {missing} rank output channel(s) did not connect to the kernel; is the kernel's address "
            "reachable from the other hosts?"))

    def accept(self, deadline: float, wanted: Iterable[int], check: Callable[[], None],
               late: Callable[[int], str]) -> None:
        """Accept until the channels ``wanted`` are connected (each proves the run's key), ``check`` called between
        looks (it raises: a start failed); ``LaunchError(late(missing))`` once ``deadline`` passes."""
        wanted = list(wanted)
        while missing := [channel for channel in wanted if channel not in self.connected]:
            check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(late(len(missing)))
            ready, _, _ = select.select([self.listener], [], [], min(left, 0.05))
            if ready:
                self._accept_one(deadline)

    def reopen(self, channels: Iterable[int]) -> None:
        """Those channels closed, to be connected again (a kept rank's new process, where the dead one's were)."""
        for channel in channels:
            old = self.connected.pop(channel, None)
            if old is not None:
                old.close()

    def _accept_one(self, deadline: float) -> None:
        accepted = wire.accept(self.listener, self.key, lambda claimed: claimed < self.channels and claimed not in self.connected,
                               timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        if accepted is not None:
            sock, channel = accepted
            _keep_alive(sock)
            self.connected[channel] = sock

    def close(self) -> None:
        self.listener.close()
        for sock in self.connected.values():
            sock.close()


def _keep_alive(sock: socket.socket) -> None:
    """TCP keepalive, short: a host that loses power or its network sends no close, and its
    channels would otherwise look open for hours; now they break within about 25 s."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):  # Linux names all three
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


@dataclass
class HostControl:
    """Exit codes of one host's ranks, read from its agent's control channel."""

    sock: socket.socket
    label: str
    codes: dict[int, int] = field(default_factory=dict)
    buffer: bytes = b""
    lost: bool = False

    def poll(self, local_index: int) -> int | None:
        if local_index in self.codes:
            return self.codes[local_index]
        if not self.lost:
            self._read()
        if local_index in self.codes:
            return self.codes[local_index]
        return -9 if self.lost else None  # the agent went away without reporting: its ranks are gone

    def _read(self) -> None:
        self.sock.setblocking(False)
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self.lost = True
                return
            self.buffer += data
            *lines, self.buffer = self.buffer.split(b"\n")
            for line in lines:
                index, code = line.split()
                self.codes[int(index)] = int(code)
