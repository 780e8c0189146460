"""A kept rank between cells: it says the cell is done, waits for the next one, and keeps what it made.

Runs in each rank of a ``--keep`` cell, on its main thread, after each cell (rank/main.py).

A kept rank does not exit when its cell ends. Its ``__main__``, its process group and whatever the
cell put on its device stay as they are; it flushes its output (Python's and C's) and writes the cell's
end on both streams (output/relay.py's ``CELL_END``: on a cluster its output travels through its host's
agent, and may come after its ``CellDone``; the kernel ends the cell once it has read both ends),
pauses its reports (nobody reads them between cells, and no health alarm may fire over a long pause),
says ``CellDone`` and waits for the next cell's spec and closure, which arrive on its channel as the
first cell's did; frames the last cell left (elements sent ahead to a loop that stopped early) are
dropped. After a kept cell failed or was interrupted the kernel sends every rank ``Abandon`` (:func:`abandoned`): a
rank still in that cell is interrupted, then every collective of the rank's process groups ends with an error, and
before the next cell's code the groups get their new communicator (rank/abortable.py): a rank that waited in a
collective for one that raised keeps its globals and its groups. The kernel interrupts a kept cell with an
``Interrupt`` frame (the ranks of a cluster are not its children): while the cell's code runs, the rank sends SIGINT
to its process group, as a terminal's ^C does, so the cell raises ``KeyboardInterrupt`` and the rank lives on; outside
the cell's code SIGINT is ignored (its set-up, what follows it, the wait between cells), and an interrupt that came
during the set-up is raised as the code begins. The kernel lets the ranks go by closing their channels (``%taas
release``, another shape, unloading); a kernel that dies ends them through their lifeline (rank/lifeline.py).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import sys
import threading
from types import ModuleType

from taas_magic.output import reports
from taas_magic.output.relay import CELL_END
from taas_magic.protocol import Abandon, CellDone, Interrupt, Spec, ToKernel, ToPeer
from taas_magic.rank import groups, recovery, shell, startup
from taas_magic.rank.inbox import Inbox
from taas_magic.runspec import RunSpec
from taas_magic.transfer.handoff import Closure, ClosureHostCopy, ReceivedClosure, receive_closure
from taas_magic.writes import outbox

_cell_running = False  # the cell's own code runs now: an interrupt is SIGINT to the process group
_cell_run = ""  # the run whose cell this is (its spec's), once its code began
_interrupted_run: str | None = None  # the run whose cell the kernel interrupted last (perhaps before its code began)
_interrupt_lock = threading.Lock()  # the reader's note of an interrupt against the cell's start (see interrupted)
_abandoned_run: str | None = None  # the last failed cell's run, whose groups' communicators are renewed before the next
_replaced: tuple[int, ...] = ()  # the ranks that died since, whose new processes join the default group only
ABORTABLE = "taas_magic.rank.abortable"  # imported by the groups only (rank/groups.py): no torch for cells without one


class InboxChannel:
    """The inbox as a channel, for what reads the next cell's closure frames in order."""

    def __init__(self, inbox: Inbox):
        self.inbox = inbox

    def send(self, frame: ToKernel) -> None:
        self.inbox.send(frame)

    def receive(self) -> ToPeer:
        frame = self.inbox.take(lambda frame: isinstance(frame, (Closure, ClosureHostCopy)))
        assert frame is not None  # no timeout: a frame, or the channel's end raised
        return frame


def interrupted(frame: Interrupt) -> None:
    """On the inbox's reader: the kernel interrupts the cell of run ``frame.run``. While its code runs, SIGINT to the
    rank's process group (the cell and what it started); before, :func:`cell_starts` raises it; after, or for
    another run's cell (one that came late), nothing. Naming the run makes the order of frames not matter: an
    interrupt right behind the next cell's spec and closure is that cell's, whichever thread sees it first.

    Exactly one of the two happens (the lock): without it, the reader could note the run as the cell's thread set
    itself running, each then see the other's write, and both raise: a second ``KeyboardInterrupt`` in what follows
    the first (the failure's report, the channel's next frame)."""
    global _interrupted_run
    with _interrupt_lock:
        _interrupted_run = frame.run
        signalled = _cell_running and frame.run == _cell_run
    if signalled:
        try:
            os.killpg(os.getpgrp(), signal.SIGINT)
        except OSError:
            os.kill(os.getpid(), signal.SIGINT)


def abandoned(frame: Abandon) -> None:
    """On the inbox's reader: kept run ``frame.run``'s cell failed or was interrupted. If the rank is still in it,
    SIGINT first (DDP's backward, released below, ends into a ``KeyboardInterrupt`` before the optimizer's step),
    then every collective of its groups ends; :func:`renew_groups` makes them new communicators."""
    global _abandoned_run, _replaced
    interrupted(Interrupt(frame.run))
    _abandoned_run, _replaced = frame.run, frame.lost
    abortable = sys.modules.get(ABORTABLE)
    if abortable is not None:
        abortable.abort_all(frame.why)


def renew_groups() -> None:
    """Before a kept cell's code: the groups a failed cell abandoned get their new communicator, on every rank in
    the order they were made (each a rendezvous of every rank, as the cell that made it was)."""
    global _abandoned_run, _replaced
    abortable = sys.modules.get(ABORTABLE)
    run, replaced, _abandoned_run, _replaced = _abandoned_run, _replaced, None, ()
    if abortable is not None and run is not None:
        if 0 in replaced:
            groups.rehome_default_group()  # rank 0's process hosted the store: its new one hosts a new one
        abortable.renew_all(run, replaced)
        if replaced and abortable.has_default_group():
            groups.match_survivors()  # as the new rank does once it joined (rank/groups.py)
        for line in recovery.reset_models():
            print(f"taas: after the failed cell, {line}", file=sys.stderr, flush=True)


def cell_starts(run: str) -> None:
    """A kept rank's cell code begins (the cell of ``run``): SIGINT raises KeyboardInterrupt in it (an interrupt of
    this cell that came while it was being set up raises it now)."""
    global _cell_running, _cell_run
    _cell_run = run  # before it runs: the reader compares both
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with _interrupt_lock:  # the reader signals the running cell, or this raises: never both (see interrupted)
        _cell_running = True
        noted = _interrupted_run == run
    if noted:
        raise KeyboardInterrupt


def cell_ends() -> None:
    """The cell's code is over: from here to the next cell's code, an interrupt is not the rank's end."""
    global _cell_running
    _cell_running = False
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def held(namespace: dict) -> CellDone:
    """What a kept rank holds as its cell ends, for what its death would lose: the names its cells bound, its
    imports apart, and whether it has a default process group."""
    names = shell.user_names(namespace)
    modules = tuple(name for name in names if isinstance(namespace[name], ModuleType))
    abortable = sys.modules.get(ABORTABLE)  # a default group a new rank can join: an abortable one
    grouped = abortable is not None and abortable.has_default_group()
    return CellDone(False, tuple(name for name in names if name not in modules), imports=modules, grouped=grouped)


def between_cells(inbox: Inbox, raised: bool, rank: int, namespace: dict) -> tuple[RunSpec, ReceivedClosure] | None:
    """Say the cell is done (``raised``: it failed, its report went first; with what ``namespace`` holds), then wait
    for the next cell: its spec and its closure (not loaded yet); None when the kernel let the ranks go.

    Raises:
        whatever receiving the next cell's closure raised, the channel being alive (the rank then exits 1).
    """
    cell_ends()
    startup.flush_output()
    _flush_c_output()
    for fd in (1, 2):  # after everything the cell printed, on each stream: the kernel reads up to here
        os.write(fd, CELL_END.encode("ascii"))
    reports.flush()
    reports.pause()
    try:
        inbox.send(dataclasses.replace(held(namespace), raised=raised))
        frame = inbox.take(lambda frame: isinstance(frame, Spec), drop_older=True)  # the last cell's leftovers go
        assert isinstance(frame, Spec)
        spec = outbox.here(frame.spec)
        renew_groups()  # every rank had the failed cell's Abandon before this Spec (one reader, in order)
        # an InboxChannel reads as a PeerChannel does
        received = receive_closure(InboxChannel(inbox), keep_original=rank == 0, own_gpu=spec.device == "cuda")  # type: ignore[arg-type]  # duck-typed
    except Exception:  # the channel ended: the kernel let us go; else the next cell cannot come (raised)
        if inbox.ended:
            return None
        raise
    reports.resume()
    return spec, received


def _flush_c_output() -> None:
    """What C code printed and its stdio still buffers (a C++ extension's ``printf``)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass  # not a C library we can ask: Python's own output was flushed
