"""One run's pdb prompts: from its ranks to the cell that waits for the run, and the person's lines back.

Runs in the kernel, on two threads: the run's own (the supervisor's :meth:`PromptDesk.arrived` and
:meth:`PromptDesk.answers`) and the cell's that waits for the run (:meth:`PromptDesk.next_prompt`,
:meth:`PromptDesk.answer`).

A rank in pdb (rank/cellpdb.py) sends a ``Prompt`` each time pdb wants a command. The run's
supervisor (its own thread) hands it here (:meth:`PromptDesk.arrived`); the cell that waits
for the run (the kernel's main thread: kernel/runs/foreground.py) takes it (:meth:`next_prompt`),
shows pdb's text and asks the person through the kernel's stdin channel (``input()``, which
ipykernel turns into an ``input_request``, as IPython's own pdb does), and gives the line back
(:meth:`answer`); the supervisor sends it to the rank (:meth:`answers`) as soon as it is woken.

Who can be prompted: a cell that waits for the run and may read input (a foreground cell,
``%taas attach``, ``%taas wait``) opens a :class:`Console` while it waits. When a rank stops
and no console is open (a ``--detach`` run nobody watches, a search's trial), or the only ones
found the frontend refuses input (``allow_stdin`` off: papermill, nbclient), the rank is told
to go on (``None``) and the run's log says in one line which rank stopped where. Several
ranks at prompts are served one after the other, in the order they stopped, each labelled.

While any rank is in pdb (:attr:`in_pdb`), the supervisor holds the others (``Hold``), pauses
``--timeout`` and shows no autopsy. ``q`` (``quit``, ``exit``) is not sent to the rank: it stops
the run as an interrupt does.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

from taas_magic import protocol
from taas_magic.peers import RANK, Peer
from taas_magic.protocol import Answer, Hold, Prompt, Resumed

QUIT_COMMANDS = frozenset({"q", "quit", "exit"})
RUNNING_SECONDS = 0.5  # the served rank has not prompted again this long after its command: it runs (a collective)


@dataclass
class Console:
    """A cell waiting for the run that can prompt the person; ``stdin`` False once the frontend refused input."""

    stdin: bool = True


@dataclass
class PromptDesk:
    say: Callable[[str, str], None]  # the run log's: (line, stream)
    record: Callable[[str], None]  # the run log's: what a console showed of a pdb session (kept on disk)
    wake_supervisor: Callable[[], None] = lambda: None  # set by the supervisor: its selector wakes
    wake_consoles: list[Callable[[], None]] = field(default_factory=list)  # a waiting cell's wake-up (foreground.py)
    consoles: list[Console] = field(default_factory=list)
    unwatched: str = "nobody is watching this run"  # why no console is open, in the one line (a search says its own)
    in_pdb: set[int] = field(default_factory=set)  # ranks in pdb now (from their first prompt until they resume)
    quit_asked: bool = False
    serving: int | None = None  # the rank whose pdb session the console is in: its prompts come first, until it resumes
    attempt: int = 0  # the ranks' attempt (--restarts): a line typed at an earlier attempt's prompt is not sent
    closed: bool = False  # the run's supervision is over: nothing is sent, nothing more is said
    _served_attempt: int = 0
    _answered_at: float = 0.0  # when the served rank was last given a line
    _waiting: deque = field(default_factory=deque)  # (rank, Prompt) not yet taken by a console
    _answers: list = field(default_factory=list)  # (rank, line or None) for the supervisor to send
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # -- the supervisor's thread -------------------------------------------------------------------
    def arrived(self, rank: int, prompt: Prompt) -> None:
        """A rank wants a command: queued for a console, or answered None (go on) when none can prompt."""
        with self._lock:
            if self.quit_asked or self.closed:
                return  # the run is being stopped: the stop ladder ends the rank, it needs no answer
            can_prompt = any(console.stdin for console in self.consoles)
            if can_prompt:
                self.in_pdb.add(rank)
                self._waiting.append((rank, prompt))
                wakes = list(self.wake_consoles)
            else:
                wakes = None
        if wakes is not None:
            for wake in wakes:
                wake()
            return
        self._go_on(rank, prompt, self.unwatched if not self.consoles
                    else "this frontend does not accept input (allow_stdin is off)")

    def resumed(self, rank: int) -> None:
        with self._lock:
            self.in_pdb.discard(rank)
            if self.serving == rank:
                self.serving = None

    def answers(self) -> list[tuple[int, str | None]]:
        """The lines to send, each to its rank, in order."""
        with self._lock:
            answers, self._answers = self._answers, []
        return answers

    def _go_on(self, rank: int, prompt: Prompt, why: str) -> None:
        if self.closed:
            return
        if prompt.first:
            self.say(_unprompted_line(rank, prompt, why), "stderr")
        with self._lock:
            self.in_pdb.discard(rank)
            if self.serving == rank:
                self.serving = None
            self._answers.append((rank, None))
        self.wake_supervisor()

    # -- the cell that waits (the kernel's main thread) -----------------------------------------------
    def open_console(self) -> Console:
        console = Console()
        with self._lock:
            self.consoles.append(console)
        return console

    def close_console(self, console: Console) -> None:
        """The cell stopped waiting: prompts nobody else can take now go on."""
        with self._lock:
            if console in self.consoles:
                self.consoles.remove(console)
        self._release_unservable("nobody is watching this run any more")

    def refused(self, console: Console, rank: int, prompt: Prompt) -> None:
        """The frontend refused input (``StdinNotImplementedError``) for ``rank``'s ``prompt``: that rank
        goes on, and this console prompts no more."""
        console.stdin = False
        why = "this frontend does not accept input (allow_stdin is off)"
        self._go_on(rank, prompt, why)
        self._release_unservable(why)

    def _release_unservable(self, why: str) -> None:
        with self._lock:
            if self.closed:
                return
            if any(console.stdin for console in self.consoles):
                return
            waiting, self._waiting = list(self._waiting), deque()
        for rank, prompt in waiting:
            self._go_on(rank, prompt, why)

    def next_prompt(self) -> tuple[int, Prompt, str] | None:
        """The next prompt to show, and the text to show before it: the served rank's until it resumes (one
        rank's session whole, then the next rank's), else the oldest."""
        with self._lock:
            if self.serving is not None and time.monotonic() - self._answered_at > RUNNING_SECONDS \
                    and not any(rank == self.serving for rank, _ in self._waiting):
                self.serving = None  # its command runs on (a collective that waits for a rank at a prompt): serve the next
            found = next((index for index, (rank, _) in enumerate(self._waiting)
                          if self.serving is None or rank == self.serving), None)
            if found is None:
                return None
            rank, prompt = self._waiting[found]
            del self._waiting[found]
            self.serving, self._served_attempt = rank, self.attempt
        text = _header(rank, prompt) + prompt.text
        self.record(text)
        return rank, prompt, text

    def answer(self, rank: int, line: str, prompt: str = "") -> None:
        """The person's ``line`` for ``rank``, typed at ``prompt`` (the log keeps both, as the page shows them)."""
        self.record(f"{prompt}{line}\n")
        with self._lock:
            if self._served_attempt != self.attempt or self.closed:
                return  # that rank is gone (the run ended, or the attempt failed and the ranks were started again)
            self._answers.append((rank, line))
            self._answered_at = time.monotonic()
        self.wake_supervisor()

    def close(self) -> None:
        """The run's supervision is over: nothing is sent, waiting prompts are dropped, nothing more is said."""
        with self._lock:
            self.closed = True
            self._waiting.clear()
            self._answers.clear()
            self.in_pdb.clear()
        self.wake_supervisor = lambda: None

    def next_attempt(self) -> None:
        """The attempt's ranks are gone (a restart follows): none of them is in pdb any more."""
        with self._lock:
            self.attempt += 1
            self.in_pdb.clear()
            self._waiting.clear()
            self._answers.clear()
            self.serving = None

    def quit(self) -> None:
        """``q`` at a prompt: the run stops (the caller asks for it); later prompts are not shown."""
        with self._lock:
            self.quit_asked = True



def _header(rank: int, prompt: Prompt) -> str:
    """The line above a rank's first prompt: which rank stopped, and why."""
    if not prompt.first:
        return ""
    if prompt.post_mortem:
        return (f"taas: rank {rank} raised {prompt.post_mortem}: post-mortem at its failing frame; the other ranks "
                "wait (c or q leaves it, and the run fails with this error)\n")
    return f"taas: rank {rank} reached a breakpoint; the other ranks wait (c continues, q stops the run)\n"


def _unprompted_line(rank: int, prompt: Prompt, why: str) -> str:
    """The one line for a stop nobody can be prompted at: which rank, where, and why."""
    place, line, function = prompt.where
    if prompt.post_mortem:
        return (f"taas: rank {rank} raised {prompt.post_mortem} at {place}, line {line}, in {function}; no post-mortem "
                f"prompt can be shown ({why})")
    return (f"taas: rank {rank} reached a breakpoint at {place}, line {line}, in {function}; no prompt can be shown "
            f"({why}), so it goes on")


class Sender(Protocol):
    def send(self, peer: Peer, body: bytes) -> bool: ...

    def wake(self) -> None: ...


class RankPrompts:
    """The supervisor's side (kernel/supervision/supervisor.py): prompts in, answers out, and every rank held while
    one is in pdb (``Hold``), released after. Without a desk (a bare supervisor in tests) a rank is told
    to go on at once."""

    def __init__(self, desk: PromptDesk | None, ranks: int, mux: Sender):
        self.desk, self.ranks, self.mux = desk, ranks, mux
        self.holding = False
        if desk is not None:
            desk.wake_supervisor = mux.wake

    def route(self, rank: int, frame: Prompt | Resumed) -> None:
        if self.desk is None:
            if isinstance(frame, Prompt):
                self.mux.send(Peer(RANK, rank), protocol.encode(Answer(None)))
        elif isinstance(frame, Prompt):
            self.desk.arrived(rank, frame)
        else:
            self.desk.resumed(rank)

    def exited(self, rank: int) -> None:
        """A rank ended (``!os._exit`` at its prompt, a signal): it is in pdb no more."""
        if self.desk is not None:
            self.desk.resumed(rank)

    def close(self) -> None:
        """The cell is over. If it ended with a rank at a prompt (stopped there), kept ranks go on unheld: the
        timeouts their cells set apply again."""
        if self.desk is not None:
            self.desk.close()
        if self.holding:
            self._hold(False)

    def _hold(self, on: bool) -> None:
        """Every rank told to hold (a rank is in pdb) or to go back to its cell's timeouts."""
        self.holding = on
        for rank in range(self.ranks):
            self.mux.send(Peer(RANK, rank), protocol.encode(Hold(on)))

    def next_attempt(self) -> None:
        if self.desk is not None:
            self.desk.next_attempt()
        self.holding = False  # the next attempt's ranks start with the cell's own timeouts

    def step(self, held: bool = False) -> None:
        """The answers sent; every rank held while one is in pdb or (``held``) stopped in the debugger panel."""
        if self.desk is not None:
            for rank, line in self.desk.answers():
                self.mux.send(Peer(RANK, rank), protocol.encode(Answer(line)))
        holding = bool(self.in_pdb) or held
        if holding != self.holding:
            self._hold(holding)

    @property
    def in_pdb(self) -> tuple[int, ...]:
        return tuple(sorted(self.desk.in_pdb)) if self.desk is not None else ()

    def stopped_lines(self) -> list[str]:
        """A stop while ranks are in pdb: the line that says so (no autopsy: nothing is hung)."""
        if not self.in_pdb:
            return []
        return [f"taas: the run was stopped while rank(s) {', '.join(map(str, self.in_pdb))} were in pdb"]
