"""The kernel's end of each Slurm task's command channel: JSON lines, each command numbered.

Runs in the kernel, on the run's own thread, where launch/slurm/step.py reads the tasks' lines.

A task sends one line when it connects (where Slurm put it), then one answer per command,
echoing the command's number; an answer that comes after its command's patience ran out is
recognised by its number and dropped, never read as the next command's. Bytes are buffered
per task, so two lines in one read, or a line split over two, are read as lines.
"""

from __future__ import annotations

import json
import select
import socket
import time
from typing import Callable, Sequence

from taas_magic.errors import LaunchError


class TaskCommands:
    """Every task's command channel of one step."""

    def __init__(self) -> None:
        self.sockets: dict[int, socket.socket] = {}
        self._buffers: dict[int, bytearray] = {}
        self.silent: set[int] = set()  # tasks whose channel closed before they were told to end
        self._number = 0

    def add(self, task: int, sock: socket.socket) -> None:
        self.sockets[task] = sock
        self._buffers[task] = bytearray()

    def greet(self, sockets: Sequence[socket.socket], deadline: float, srun_said: Callable[[], str]) -> list[dict]:
        """Each task's command channel (by task), and its first line, where Slurm put it: the hellos, by task."""
        hellos = []
        for task, sock in enumerate(sockets):
            self.add(task, sock)
            try:
                hellos.append(self.read(task, deadline))
            except (ConnectionError, TimeoutError, ValueError) as exc:
                raise LaunchError(f"taas: a task of the srun step did not say where it runs ({exc}); "
                                  f"srun said: {srun_said()}") from None
        return sorted(hellos, key=lambda hello: hello["task"])

    def started(self, hellos: Sequence[dict]) -> None:
        """Raises LaunchError where a task said something unasked while starting: its rank could not be started."""
        for hello in hellos:
            task = hello["task"]
            if self.pending(task):
                try:
                    said = self.read(task, time.monotonic() + 1.0).get("error", "it said nothing more")
                except (ConnectionError, TimeoutError, ValueError, OSError):
                    said = "it exited"
                raise LaunchError(f"taas: the Slurm task of rank {task} on {hello['node']} could not start the rank: {said}")

    def read(self, task: int, deadline: float) -> dict:
        """The task's next line; ConnectionError once its channel closed, TimeoutError at ``deadline``."""
        buffer, sock = self._buffers[task], self.sockets[task]
        while b"\n" not in buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"task {task} did not answer")
            ready, _, _ = select.select([sock], [], [], left)
            if not ready:
                continue
            chunk = sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError(f"task {task} closed its channel")
            buffer += chunk
        line, _, rest = bytes(buffer).partition(b"\n")
        buffer[:] = rest
        return json.loads(line)

    def pending(self, task: int) -> bool:
        """Whether the task said something (or closed its channel) that was not asked for."""
        if self._buffers[task]:
            return True
        ready, _, _ = select.select([self.sockets[task]], [], [], 0)
        return bool(ready)

    def tell(self, task: int, message: dict) -> int:
        """Send ``message`` to the task without waiting for its answer; the number the answer will carry."""
        self._number += 1
        self.sockets[task].sendall(json.dumps({**message, "number": self._number}).encode() + b"\n")
        return self._number

    def answer(self, task: int, number: int, deadline: float, wait: bool = True) -> dict | None:
        """The task's answer to request ``number`` (late answers to older ones skipped); without ``wait``, None
        while none has come."""
        while wait or self.pending(task):
            answer = self.read(task, deadline)
            if answer.get("number") == number:
                return answer
        return None

    def ask(self, tasks: Sequence[int], message: dict, patience: float) -> dict[int, dict]:
        """Send ``message`` to those tasks, then read their answers to it until ``patience`` passes."""
        self._number += 1
        asked = []
        for task in tasks:
            if task not in self.sockets or task in self.silent:
                continue
            try:
                self.sockets[task].sendall(json.dumps({**message, "number": self._number}).encode() + b"\n")
                asked.append(task)
            except OSError:
                self.silent.add(task)
        deadline = time.monotonic() + patience
        answers: dict[int, dict] = {}
        for task in asked:
            try:
                while (answer := self.read(task, deadline)).get("number") != self._number:
                    pass  # a late answer to a command whose patience ran out
                answers[task] = answer
            except TimeoutError:  # (an OSError too: first)
                continue  # it hangs: close() kills the step
            except (ConnectionError, OSError, ValueError):
                self.silent.add(task)  # it died, or its node did: close() kills what is left of the step
        return answers
