"""One run's ranks as the debugger panel's threads: questions out to the ranks, their answers and stops back.

Runs in the kernel, on two threads: :meth:`RankLink.ask` and :meth:`RankLink.tell_all` on ipykernel's
control thread (debugger/panel.py, where the panel's ``debug_request`` arrives); everything else on the
run's own thread (kernel/supervision/supervisor.py), the one thread that sends the ranks frames and reads
theirs. A lock guards what both touch.

Ids: each rank is one DAP thread, ``THREAD_BASE + rank``, named ``rank K`` (``rank K (host)`` off this
host). A rank numbers its frames and variable containers from 1 at each stop (debugger/frameview.py);
the panel sees them as ``THREAD_BASE + rank * RANK_SPAN + id`` (:func:`panel_id`), far above debugpy's
own small numbers, so one request names one rank or the kernel's debugpy, never both.

A rank's ``PanelStopped`` and ``PanelResumed`` become the panel's ``stopped`` and ``continued`` events on
IOPub (``debug_event``); while any rank is stopped the supervisor holds the others as a pdb prompt
does (:attr:`RankLink.stopped`, kernel/supervision/prompts.py). When the run ends, every question not
answered is answered with why, and its stopped ranks are said to continue.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from taas_magic import protocol
from taas_magic.protocol import ToPeer

THREAD_BASE = 1 << 30  # the first rank's thread id; debugpy's ids are small numbers
RANK_SPAN = 1 << 20  # ids of one rank's frames and variables: a stop hands out fewer


@dataclass(frozen=True)
class PanelCommand(ToPeer, kind="panel-command"):
    """A panel request for a stopped rank (``stackTrace``, ``variables``, ``continue``, ...), its ids the rank's own."""

    seq: int
    command: str
    arguments: dict


@dataclass(frozen=True)
class PanelNow(ToPeer, kind="panel-now"):
    """For a rank that runs: the panel's breakpoints now (None: unchanged), or ``pause``."""

    breakpoints: tuple[tuple[str, tuple[int, ...]], ...] | None = None
    pause: bool = False


def panel_id(rank: int, local: int) -> int:
    """A rank's frame or variables id as the panel sees it (0 stays 0: nothing to open)."""
    return THREAD_BASE + rank * RANK_SPAN + local if local else 0


def rank_of(panel: int) -> tuple[int, int] | None:
    """(rank, its own id) for an id the panel got from a rank; None for debugpy's."""
    if panel < THREAD_BASE:
        return None
    rank, local = divmod(panel - THREAD_BASE, RANK_SPAN)
    return rank, local


def thread_rank(thread: int, ranks: int) -> int | None:
    rank = thread - THREAD_BASE
    return rank if 0 <= rank < ranks else None


class RankLink:
    """One run's ranks for the panel (see the module docstring)."""

    def __init__(self, ranks: int, publish: Callable[[dict], None]):
        self.ranks, self.publish = ranks, publish
        self.names = {rank: f"rank {rank}" for rank in range(ranks)}
        self.stopped: dict[int, dict] = {}  # each stopped rank's ``stopped`` event body
        self._lock = threading.Lock()
        self._outgoing: list[tuple[int, bytes]] = []
        self._waiting: dict[int, Future] = {}  # seq -> the control thread's answer to come
        self._seq = 0
        self._wake: Callable[[], None] = lambda: None
        self._closed = False

    # -- the control thread ----------------------------------------------------------------------
    def ask(self, rank: int, command: str, arguments: dict) -> Future:
        """A stopped rank's answer to come (a DAP body; a ``LookupError`` naming why not)."""
        answer: Future = Future()
        with self._lock:
            if self._closed or rank not in self.stopped:
                answer.set_exception(LookupError(f"rank {rank} is not stopped"))
                return answer
            self._seq += 1
            self._waiting[self._seq] = answer
            self._outgoing.append((rank, protocol.encode(PanelCommand(self._seq, command, arguments))))
        self._wake()
        return answer

    def tell_all(self, frame: PanelNow, only: int | None = None) -> None:
        """``frame`` to every rank (``only``: to that one); a pause only to ranks that run. A stopped rank takes new
        breakpoints on its reader thread, and they hold once it goes on."""
        with self._lock:
            if self._closed:
                return
            body = protocol.encode(frame)
            self._outgoing.extend((rank, body) for rank in range(self.ranks)
                                  if only in (None, rank) and not (frame.pause and rank in self.stopped))
        self._wake()

    @property
    def running(self) -> bool:
        """The run's cell still runs (the panel keeps its link until the next run)."""
        return not self._closed

    def threads(self) -> list[dict]:
        return [{"id": THREAD_BASE + rank, "name": name} for rank, name in sorted(self.names.items())]

    def stopped_threads(self) -> list[int]:
        with self._lock:
            return [THREAD_BASE + rank for rank in sorted(self.stopped)]

    # -- the run's thread ------------------------------------------------------------------------
    def attach(self, wake: Callable[[], None], hosts: dict[int, str]) -> None:
        """The attempt's ranks are watched: their names (with their hosts where not this one), the supervisor's wake."""
        self._wake = wake
        self.names = {rank: f"rank {rank}" if host in ("", "localhost") else f"rank {rank} ({host})"
                      for rank, host in hosts.items()}
        for rank in sorted(self.names):
            self.publish(_event("thread", {"reason": "started", "threadId": THREAD_BASE + rank}))

    def outgoing(self) -> list[tuple[int, bytes]]:
        with self._lock:
            sending, self._outgoing = self._outgoing, []
        return sending

    def replied(self, seq: int, reply: Any) -> None:
        """A rank's ``PanelReply`` (debugger/tracer.py) to question ``seq``."""
        with self._lock:
            answer = self._waiting.pop(seq, None)
        if answer is not None:
            answer.set_result(reply)

    def stopped_at(self, rank: int, reason: str, line: int) -> None:
        """A rank's ``PanelStopped``: the panel's ``stopped`` event for its thread."""
        body = {"reason": reason, "threadId": THREAD_BASE + rank, "description": f"{self.names.get(rank, rank)}, "
                f"line {line}", "allThreadsStopped": False, "preserveFocusHint": False}
        with self._lock:
            self.stopped[rank] = body
        self.publish(_event("stopped", body))

    def continued(self, rank: int, stepping: bool = False) -> None:
        """A rank's ``PanelResumed`` (or its run's end): the panel's ``continued`` event. A rank let go (not
        stepping) while others stay stopped: the lowest of them is said stopped again, so a panel that shows one
        thread at a time (JupyterLab's shows the last ``stopped``) shows the next rank, not nothing."""
        with self._lock:
            if self.stopped.pop(rank, None) is None:
                return
            shown = None if stepping or self._closed or not self.stopped else self.stopped[min(self.stopped)]
        self.publish(_event("continued", {"threadId": THREAD_BASE + rank, "allThreadsContinued": False}))
        if shown is not None:
            self.publish(_event("stopped", shown))

    def close(self) -> None:
        """The run is over: no rank is stopped any more, and no answer will come."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting.values()), {}
            self._outgoing.clear()
            self._wake = _nothing  # the panel keeps this link until the next run: not the run's supervisor
        for answer in waiting:
            answer.set_exception(LookupError("the rank's cell is over"))
        for rank in sorted(self.stopped):
            self.continued(rank)
        for rank in sorted(self.names):
            self.publish(_event("thread", {"reason": "exited", "threadId": THREAD_BASE + rank}))


def _nothing() -> None:
    pass


def _event(name: str, body: dict) -> dict:
    return {"seq": 0, "type": "event", "event": name, "body": body}
