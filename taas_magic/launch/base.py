"""The contract between the supervisor and a launcher (local processes, or Ray later).

A launcher turns a :class:`LaunchPlan` into a :class:`ProcessGroup`. The supervisor only
reads rank output fds, polls exit codes, and calls ``stop``/``close``; it never asks
which launcher is in use (as torch's ``PContext`` and httpx's ``BaseTransport``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import TracebackType
from typing import Mapping, Protocol, Sequence

from taas_magic.wire import Placement


@dataclass(frozen=True)
class LaunchPlan:
    """Everything needed to start the ranks of one run."""

    world_size: int
    envs: Sequence[Mapping[str, str]]  # one environment per rank, index = RANK
    cwd: str
    handshake: str  # rank/startup.py's Handshake line, written on each rank's stdin (never in its environment)
    places: Sequence[Placement]  # each one's id, name and write rule, the next line on its stdin; index = RANK
    stack_files: Sequence[str] = field(default=())  # where each rank's autopsy lands (autopsy/dump.py), index = RANK

    def part(self, first: int, count: int) -> "LaunchPlan":
        """Ranks ``first`` .. ``first + count - 1`` of this plan (one host's share), renumbered from 0."""
        return LaunchPlan(count, self.envs[first:first + count], self.cwd, self.handshake,
                          self.places[first:first + count], self.stack_files[first:first + count])


class ChildProcess(Protocol):
    """One process a launcher started: a rank (``index`` = its RANK) or a data worker (its number)."""

    index: int
    stdout_fd: int
    stderr_fd: int
    exit_fd: int | None  # readable once the process has exited (a pidfd), or None: poll() is polled

    @property
    def host(self) -> str:
        """Where it runs, as a failure names it."""

    def poll(self) -> int | None:
        """The exit code once the process has exited (negative: killed by that signal)."""


class ProcessGroup(Protocol):
    @property
    def children(self) -> Sequence[ChildProcess]:
        """The processes, in ``index`` order."""

    def stop(self, graceful: bool = True) -> list[str]:
        """Stop every rank (INT -> TERM -> KILL; TERM -> KILL unless ``graceful``); return the signals it took."""

    def stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Each of those ranks' thread stacks, as stacks.take reads them (the hang autopsy)."""

    def close(self) -> None:
        """Idempotent: stop what still runs, reap everything, release every fd."""

    def __enter__(self) -> "ProcessGroup": ...

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """:meth:`close`: a group is a context manager, closed on leaving it whatever happened."""
