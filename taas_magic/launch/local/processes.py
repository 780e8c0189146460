"""Ranks as fresh local processes: never forked from the kernel, each in its own session.

Runs in the kernel, on the run's own thread (a run's ranks and data workers), and in a Ray host
agent or Slurm task, which starts its host's ranks with it (launch/hosts/agent.py).

Forking a kernel that has touched CUDA breaks the child ("cannot re-initialize CUDA in
forked subprocess"); starting ``python -m taas_magic.rank`` does not. Each rank gets:

- its own stdout/stderr pipes (never the kernel's fds 1 and 2, which ipykernel points
  at whatever cell is current);
- a stdin pipe that carries the handshake and then serves as its lifeline;
- its own session and process group, so stopping a rank stops what its cell started.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from types import TracebackType
from typing import Sequence

from taas_magic.errors import LaunchError
from taas_magic.launch.contract import RANK_COMMAND, ChildProcess, LaunchPlan
from taas_magic.launch.local.spares import SparePool
from taas_magic.launch.rankenv import Binding
from taas_magic.procs import LADDER, RESTART_LADDER, Process, exit_fd, kill_leftovers, reap, signal_group, stop_groups

PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def _widen_pipe(fd: int) -> None:
    """1 MB pipes (Linux), so a rank printing a flood rarely waits for the kernel to read."""
    try:
        fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        pass  # above /proc/sys/fs/pipe-max-size, or not Linux: the default 64 kB pipe works


@dataclass
class LocalChild:
    index: int
    process: Process  # a fresh interpreter, or a spare: maybe a fork of the spare factory
    host: str = "localhost"
    stdout_fd: int = field(init=False)
    stderr_fd: int = field(init=False)
    exit_fd: int | None = field(init=False)

    def __post_init__(self) -> None:
        assert self.process.stdout is not None and self.process.stderr is not None  # started with PIPE
        self.stdout_fd = self.process.stdout.fileno()
        self.stderr_fd = self.process.stderr.fileno()
        for fd in (self.stdout_fd, self.stderr_fd):
            _widen_pipe(fd)
        self.exit_fd = exit_fd(self.process.pid)  # the supervisor wakes the moment the rank ends

    def close_exit_fd(self) -> None:
        if self.exit_fd is not None:
            os.close(self.exit_fd)
            self.exit_fd = None

    def poll(self) -> int | None:
        code = self.process.poll()
        if code is not None:
            kill_leftovers(self.process)
        return code


class LocalProcessGroup:
    """N rank processes (or M data worker processes) on this host."""

    def __init__(self, ranks: list[LocalChild], stack_files: Sequence[str] = ()):
        self.children = ranks
        self.stack_files = list(stack_files)  # where each rank's autopsy lands (autopsy/dump.py)
        self._interrupted: set[int] = set()  # pids sent SIGINT by interrupt(): the stop ladder does not send another
        self._closed = False
        self._spares: SparePool | None = None  # where its ranks came from, for one that replaces a dead one
        self._wanted: list[Binding] = []

    @classmethod
    def start(
        cls,
        plan: LaunchPlan,
        command: tuple[str, ...] = RANK_COMMAND,
        what: str = "rank",
        spares: SparePool | None = None,
        wanted: Sequence[Binding] = (),
    ) -> "LocalProcessGroup":
        """Start the ranks: rank ``k`` from a warm spare that serves ``wanted[k]`` (bound to its
        GPU, or a CPU spare; ready or still warming), the rest as fresh processes (launch/local/spares.py)."""
        warm = spares.take(wanted) if spares is not None and wanted else [None] * plan.world_size
        ranks: list[LocalChild] = []
        try:
            for rank in range(plan.world_size):
                ranks.append(_launch(plan, rank, command, warm[rank]))
        except (OSError, subprocess.SubprocessError) as exc:
            cls(ranks).close()
            unused = [LocalChild(k, p) for k, p in enumerate(warm) if p is not None and k > len(ranks)]  # (not the
            # one that failed: _launch closed it)
            cls(unused).close()
            raise LaunchError(f"taas: could not start {what} {len(ranks)}: {exc}") from exc
        group = cls(ranks, plan.stack_files)
        group._spares, group._wanted = spares, list(wanted)
        return group

    def replace(self, rank: int, plan: LaunchPlan) -> ChildProcess:
        """A new process in dead rank ``rank``'s place, as ``plan`` starts that rank (from a warm spare that serves
        it, or fresh); the dead one reaped."""
        dead = self.children[rank]
        reap(dead.process)
        dead.close_exit_fd()
        spares, wanted = self._spares, self._wanted
        warm = spares.take([wanted[rank]])[0] if spares is not None and len(wanted) > rank else None
        try:
            self.children[rank] = _launch(plan, rank, RANK_COMMAND, warm)  # (closes what it started, failing)
        except (OSError, subprocess.SubprocessError) as exc:
            raise LaunchError(f"taas: could not start a new rank {rank}: {exc}") from exc
        return self.children[rank]

    def interrupt(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            process = self.children[rank].process
            if process.poll() is None and process.pid not in self._interrupted:
                self._interrupted.add(process.pid)
                signal_group(process.pid, signal.SIGINT)  # its own session: the group is the rank's pid

    def stop(self, graceful: bool = True) -> list[str]:
        processes = [rank.process for rank in self.children]
        return stop_groups(processes, LADDER if graceful else RESTART_LADDER, self._interrupted).signals

    def stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        from taas_magic.autopsy.stacks import take

        files = dict(enumerate(self.stack_files))
        return take({rank: (self.children[rank].process.pid, path) for rank in ranks if (path := files.get(rank))})

    def __enter__(self) -> "LocalProcessGroup":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        stop_groups([rank.process for rank in self.children], interrupted=self._interrupted)
        for rank in self.children:
            reap(rank.process)
            rank.close_exit_fd()


def _launch(plan: LaunchPlan, rank: int, command: tuple[str, ...], warm: Process | None) -> LocalChild:
    """Rank ``rank`` of ``plan``: the spare ``warm`` told its settings, or a fresh process; then its place."""
    env = plan.envs[rank]
    if warm is not None:
        settings = json.dumps({"env": dict(env), "cwd": plan.cwd})
        process, message = warm, f"{plan.handshake}\n{settings}\n{plan.places[rank].line()}\n"
    else:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env=dict(env), cwd=plan.cwd, start_new_session=True, close_fds=True)
        message = f"{plan.handshake}\n{plan.places[rank].line()}\n"
    child = LocalChild(rank, process)
    assert process.stdin is not None  # started with PIPE
    try:
        process.stdin.write(message.encode("utf-8"))
        process.stdin.flush()
    except OSError:
        LocalProcessGroup([child]).close()
        raise
    return child
