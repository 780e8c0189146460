"""The kernel's half of the spare factory (rank/factory.py): start it, ask it for spares, hear their exits.

Runs in the kernel, on whichever thread asks for spares: the cell's (the extension's load, a cell's
ranks), the run's own, or the standby thread (launch/local/standby.py); the factory itself is a
process of its own (rank/factory.py).

:class:`SpareFactory` starts ``python -m taas_magic.rank --spare --factory FD`` once (as the
extension loads, or with the first spares); while it imports, :meth:`SpareFactory.spawn`
says None and the pool starts a spare the slow way (a fresh interpreter), except for a
cell's rank that has no spare: that request waits for the factory, whose imports are ahead
of any fresh interpreter's. Once it is ready, a spare is a fork of it: the kernel makes the
spare's three pipes, hands their far ends over the socket, and gets a :class:`ForkedSpare`,
which the pool, the launcher and the stop ladder use as they use a ``subprocess.Popen``:
``pid``, the pipes, ``poll``, ``wait``. Its exit code comes from the factory, its parent.

The factory fixes what a spare fixes when it imports (launch/local/spares.py's frozen settings):
it serves while the kernel's values are the ones it started under, and is retired (it
leaves once its last spare has ended) when they change or the spares are turned off.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Callable

from taas_magic.launch.rankenv import Binding
from taas_magic.procs import exit_fd, pid_alive

FACTORY_COMMAND = (sys.executable, "-m", "taas_magic.rank", "--spare", "--factory")
# a ready factory forks in milliseconds; past this it is taken for broken. A request that comes while it takes
# its first step (rank/factory.py) waits for the step: about 1 s of CPU, 4 to 5 s of wall time on a loaded 2-core
# machine, where the 5 s this was took a working factory for broken
ANSWER_SECONDS = 30.0
# how long a cell's rank waits for a factory still importing (1 to 2 s here, 3 to 4 s with a CUDA build;
# a fresh interpreter would take as long) before it is taken for broken and the rank starts fresh
IMPORT_SECONDS = 60.0
EXIT_REPORT_SECONDS = 1.0  # a spare that ended is reported by the factory within milliseconds (its pidfd wakes it)
MESSAGE_BYTES = 64 * 1024


class SpareFactory:
    """One factory process and the exits it reported."""

    def __init__(self, env: dict[str, str], settings: dict[str, str], step: bool, compiler: bool = False):
        """Start it with ``env`` (one thread for OpenMP and BLAS); ``settings`` are the kernel's
        frozen settings it imports under; with ``step`` (a host without GPUs) it also takes the
        spares' first CPU training step before it forks them; with ``compiler`` (the session compiles)
        it also imports torch's compiler and probes the CPU for it (rank/factory.py's ``warm_compiler``)."""
        self.settings, self.compiler = settings, compiler
        self.exits: dict[int, int] = {}
        self._spawned: list[int] = []  # forks it reported, for the request waiting on one
        # the socket is read from the pool's thread (a spawn) and from every run's supervisor thread
        # (its ranks' exits): one reader at a time, and what one reads is kept for whoever it is for
        self._reading = threading.Lock()
        self.ready = False
        self.broken = False
        self.retired = False
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                (*FACTORY_COMMAND, str(theirs.fileno()), *(["--step"] if step else []),
                 *(["--compiler"] if compiler else [])), stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=os.getcwd(),
                start_new_session=True, pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        self._control.setblocking(False)

    def serves(self, settings: dict[str, str]) -> bool:
        """Whether it forks (now, or once it has imported) for a kernel whose frozen settings are
        ``settings``: not broken, not retired, and started under those settings."""
        return not (self.broken or self.retired) and self.settings == settings

    def spawn(self, binding: Binding, for_cell: bool = False) -> ForkedSpare | None:
        """A forked spare with its ``binding`` (its GPU, and the ``CUDA_VISIBLE_DEVICES`` it sets
        before CUDA starts), or None if it broke (start one the slow way). While the factory
        still imports: None at once, or, ``for_cell`` (the rank of a cell that has no spare),
        the request waits in its socket and is the first thing it answers, within
        ``IMPORT_SECONDS``; such a spare skips the first CPU step (the cell is waiting), and a factory
        that finds the request waiting as it finishes importing takes the step later, once its forks
        have ended (rank/factory.py). One spare at a time."""
        self.collect()
        if self.broken or self.retired or not (self.ready or (for_cell and self.alive())):
            return None
        pipes = [os.pipe() for _ in range(3)]
        mine = [pipes[0][1], pipes[1][0], pipes[2][0]]  # we write its stdin, read its stdout and stderr
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1]]
        request = {"gpu": binding.gpu, "visible": binding.visible, "cwd": os.getcwd(), "for_cell": for_cell}
        try:
            self._spawned.clear()
            socket.send_fds(self._control, [json.dumps(request).encode()], theirs)
            answer = ANSWER_SECONDS if self.ready else IMPORT_SECONDS  # its imports come first
            pid = self._await(lambda: self._spawned.pop(0) if self._spawned else None, answer,
                              gives_up=lambda: self.retired)  # it refused: it is retiring
        except OSError:
            pid = None
        except BaseException:  # interrupted while it imports: a fork it makes later finds its stdin closed and leaves
            for fd in mine:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)
        if pid is None:
            self.broken = self.broken or not self.retired  # a refusal is not a fault
            for fd in mine:
                os.close(fd)
            return None
        return ForkedSpare(self, pid, *mine)

    def collect(self) -> None:
        """Read what the factory said since (non-blocking): its readiness, its forks, its spares' exits."""
        with self._reading:
            while True:
                try:
                    message = self._control.recv(MESSAGE_BYTES)
                except BlockingIOError:
                    return
                except OSError:
                    message = b""
                if not message:
                    self.broken = True  # it is gone: spares it forked and that are still running end when their lifeline does
                    return
                self._heard(json.loads(message))

    def _heard(self, message: dict) -> None:
        if message.get("ready"):
            self.ready = True
        if message.get("refused"):
            self.retired = True
        if "exited" in message:
            self.exits[message["exited"]] = message["code"]
        if "spawned" in message:
            self._spawned.append(message["spawned"])

    def await_exit(self, pid: int) -> int | None:
        """Spare ``pid`` has ended (its pidfd says so): its exit code, once the factory reports it."""
        return self._await(lambda: self.exits.pop(pid, None), EXIT_REPORT_SECONDS)

    def _await(self, heard: Callable[[], int | None], seconds: float,
               gives_up: Callable[[], bool] = lambda: False) -> int | None:
        """What ``heard`` finds in what the factory says within ``seconds`` (None: nothing, it broke,
        or ``gives_up`` said so)."""
        deadline = time.monotonic() + seconds
        while True:
            self.collect()
            found = heard()
            if found is not None or self.broken or gives_up():
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                select.select([self._control], [], [], min(left, 0.05))
            except (OSError, ValueError):  # closed meanwhile (the factory left): what it said was kept
                return heard()

    def alive(self) -> bool:
        return self.process.poll() is None

    def retire(self) -> None:
        """Fork no more; it leaves once the spares it forked have ended (it reports their exits until then)."""
        self.retired = True
        try:
            self._control.send(json.dumps({"retire": True}).encode())
        except OSError:
            pass

    def end_unused(self) -> None:
        """End one that never forked (a compiler factory not yet serving: launch/local/spares.py) at once."""
        self.process.kill()
        self.close()

    def close(self) -> None:
        """Now (the kernel leaves, or the extension unloads): its stdin closes and it exits."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        with self._reading:  # a reader in the middle of a message finishes it first
            self._control.close()


class ForkedSpare:
    """A spare the factory forked, used where a ``subprocess.Popen`` is: its pid (it leads its own
    session), its pipes, and its exit code once the factory reported it."""

    def __init__(self, factory: SpareFactory, pid: int, stdin: int, stdout: int, stderr: int):
        self.factory, self.pid = factory, pid
        self.stdin: IO[bytes] | None = os.fdopen(stdin, "wb")
        self.stdout: IO[bytes] | None = os.fdopen(stdout, "rb", buffering=0)
        self.stderr: IO[bytes] | None = os.fdopen(stderr, "rb", buffering=0)
        self.returncode: int | None = None
        self._exit_fd = exit_fd(pid)  # readable once it ends: then its code is due (None: when the factory next looks)

    def poll(self) -> int | None:
        if self.returncode is None and self._exit_fd is not None and not self._ended():
            return None  # its pidfd says it runs: nothing to read from the factory (a kept cell polls its ranks often)
        if self.returncode is None:
            self.factory.collect()
            self.returncode = self.factory.exits.pop(self.pid, None)
            if self.returncode is None and self._ended():
                self.returncode = self.factory.await_exit(self.pid)  # reported within milliseconds
            if self.returncode is None and self.factory.broken and not pid_alive(self.pid):
                self.returncode = -9  # its parent died before it could say: killed with it
            if self.returncode is not None and self._exit_fd is not None:
                os.close(self._exit_fd)
                self._exit_fd = None
        return self.returncode

    def _ended(self) -> bool:
        """Whether it has exited, reaped or not (its pidfd is readable); False where there is no pidfd."""
        return self._exit_fd is not None and bool(select.select([self._exit_fd], [], [], 0)[0])

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"spare {self.pid}", timeout or 0.0)
            time.sleep(0.005)
        return code
