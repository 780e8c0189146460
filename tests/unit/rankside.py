"""The kernel's end of a rank's channel, and a rank as a real child process, for the tests of taas_magic/rank/.

The kernel's end is a real :class:`PeerServer` on loopback (kernel/supervision/server.py): a peer connects with
wire.py's authenticated hello and every frame both ways is MAC'd (wire.py) and typed (protocol.py). A rank is
``python -c SCRIPT`` in a session of its own (so SIGINT to its process group, or a SIGKILL of it, reaches it and
what it started, never pytest), given the handshake line ``HOST PORT KEY`` on its stdin as rank/startup.py reads it.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import textwrap
import threading
import time

from taas_magic import protocol, wire
from taas_magic.kernel.supervision.server import PeerConnection, PeerServer
from taas_magic.protocol import ToKernel, ToPeer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WAIT = 60.0  # seconds anything a test waits for may take on a loaded machine before the test fails


class KernelEnd:
    """A listener for ``ranks`` peers; :meth:`accept` gives the next one that proved the key."""

    def __init__(self, ranks: int = 1) -> None:
        self.key = wire.new_key()
        self.server = PeerServer(self.key, ranks)

    def handshake(self) -> str:
        """The line a rank reads first on its stdin."""
        host, port = self.server.address
        return wire.Handshake(host, port, self.key).line()

    def accept(self, timeout: float = WAIT) -> Rank:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.server.listener, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(deadline - time.monotonic()):
                    continue
                peer = self.server.accept()
                if peer is None:
                    continue
                with selectors.DefaultSelector() as hello:
                    hello.register(peer.sock, selectors.EVENT_READ)
                    while time.monotonic() < deadline:
                        hello.select(deadline - time.monotonic())
                        outcome = self.server.read_hello(peer)
                        if outcome is False:
                            self.server.drop(peer)
                            raise AssertionError("a peer did not prove the key")
                        if outcome is not None:
                            return Rank(outcome)
        raise TimeoutError("no peer connected")

    def close(self) -> None:
        self.server.close()


class Rank:
    """One connected peer, as the kernel sees it: typed frames sent and received."""

    def __init__(self, connection: PeerConnection) -> None:
        self.connection = connection
        self.peer_id = connection.peer_id
        self._arrived: list[ToKernel] = []

    def send(self, *frames: ToPeer) -> None:
        """The frames, each MAC'd, in one burst (they reach the rank together)."""
        for frame in frames:
            self.connection.send(protocol.encode(frame))

    def receive(self, timeout: float = WAIT) -> ToKernel:
        """The next frame from the rank. Raises TimeoutError, or ConnectionError when the rank closed its end."""
        deadline = time.monotonic() + timeout
        sock = self.connection.sock
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            while not self._arrived:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no frame from the rank")
                if not selector.select(left):
                    continue
                try:
                    data = sock.recv(1 << 20)
                except BlockingIOError:
                    continue
                if not data:
                    raise ConnectionError("the rank closed its channel")
                for kind, body in self.connection.reader.feed(data):
                    self._arrived.append(protocol.decode(kind, body, ToKernel))
        return self._arrived.pop(0)

    def close(self) -> None:
        self.connection.sock.close()


def connect_here(kernel: KernelEnd, peer_id: int = 0) -> tuple[protocol.PeerChannel, Rank]:
    """A rank's channel in this process (for parts that change no process state), and the kernel's end of it."""
    accepted: list[Rank] = []
    thread = threading.Thread(target=lambda: accepted.append(kernel.accept()), name="test-accept", daemon=True)
    thread.start()
    host, port = kernel.server.address
    channel = protocol.PeerChannel(wire.BlockingChannel.connect(host, port, kernel.key, peer_id))
    thread.join(WAIT)
    assert accepted, "the kernel's end did not accept the rank"
    return channel, accepted[0]


def start(script: str, *lines: str, env: dict[str, str] | None = None, cwd: str = ROOT) -> subprocess.Popen:
    """``python -c script`` in a session of its own, ``lines`` written on its stdin (which stays open: its
    lifeline), its stdout and stderr piped."""
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=cwd, env=env, start_new_session=True)
    assert child.stdin is not None
    for line in lines:
        child.stdin.write(line.encode() + b"\n")
    child.stdin.flush()
    return child


def finish(child: subprocess.Popen, timeout: float = WAIT) -> tuple[int, str, str]:
    """Wait for the child to end by itself, its stdin (the lifeline) held open meanwhile, as the kernel holds it:
    (exit code, stdout, stderr). Its session is killed first if it runs past ``timeout``."""
    assert child.stdout is not None and child.stderr is not None
    read = {child.stdout.fileno(): bytearray(), child.stderr.fileno(): bytearray()}
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        for fd in read:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(deadline - time.monotonic()):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    read[key.fd] += chunk
                else:
                    selector.unregister(key.fd)
    try:
        child.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    if child.poll() is None:
        end(child)
    out, err = (bytes(read[stream.fileno()]).decode(errors="replace") for stream in (child.stdout, child.stderr))
    return child.returncode, out, err


def end(child: subprocess.Popen) -> None:
    """SIGKILL the child's own process group (it leads it: ``start_new_session``), and reap the child."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for stream in (child.stdin, child.stdout, child.stderr):
        if stream is not None:
            stream.close()
    child.wait(timeout=WAIT)


def gone(pid: int, timeout: float = WAIT) -> bool:
    """Whether process ``pid`` is gone, or a zombie, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                if stat.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    return True
        except (OSError, IndexError):
            return True
        time.sleep(0.02)
    return False


def said_by(prologue: str, code: str, *args: str, timeout: float = WAIT) -> dict:
    """``prologue`` then ``code`` (dedented) run as ``python -c`` with ``args``, this checkout importable; the JSON
    of the ``said`` dict it fills, printed last. A child that fails fails the test with its stderr."""
    script = prologue + textwrap.dedent(code) + "\nprint(json.dumps(said))\n"
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])
