"""A kept rank between cells: it says the cell is done, waits for the next one, and keeps what it made.

Runs in each rank of a ``--keep`` cell, on its main thread, after each cell (rank/main.py).

A kept rank does not exit when its cell ends. Its ``__main__``, its process group and whatever the
cell put on its device stay as they are; it flushes its output (Python's and C's: the kernel ends the
cell when every rank said ``CellDone``, and what the rank printed before that is then in its pipes),
pauses its reports (nobody reads them between cells, and no health alarm may fire over a long pause),
says ``CellDone`` and waits for the next cell's spec and closure, which arrive on its channel as the
first cell's did. The kernel interrupts a kept cell with an ``Interrupt`` frame (the ranks of a cluster
are not its children): the rank sends SIGINT to its process group, as a terminal's ^C does, so the cell
raises ``KeyboardInterrupt`` and the rank lives on. One that arrives between cells (late, for a cell
that already ended) is ignored. The kernel lets the ranks go by closing their channels (``%taas release``, another shape,
unloading); a kernel that dies ends them through their lifeline (rank/lifeline.py).
"""

from __future__ import annotations

import ctypes
import os
import signal

from taas_magic.output import reports
from taas_magic.protocol import CellDone, Interrupt, Spec, ToKernel, ToPeer
from taas_magic.rank import startup
from taas_magic.rank.inbox import Inbox
from taas_magic.runspec import RunSpec
from taas_magic.transfer.handoff import ReceivedClosure, receive_closure
from taas_magic.writes import outbox


class InboxChannel:
    """The inbox as a channel, for what reads its frames in order (the next cell's closure)."""

    def __init__(self, inbox: Inbox):
        self.inbox = inbox

    def send(self, frame: ToKernel) -> None:
        self.inbox.send(frame)

    def receive(self) -> ToPeer:
        frame = self.inbox.take(lambda _frame: True)
        assert frame is not None  # no timeout: a frame, or the channel's end raised
        return frame


def interrupted(_frame: Interrupt) -> None:
    """On the inbox's reader: SIGINT to the rank's process group (the cell and what it started)."""
    try:
        os.killpg(os.getpgrp(), signal.SIGINT)
    except OSError:
        os.kill(os.getpid(), signal.SIGINT)


def between_cells(inbox: Inbox, raised: bool, rank: int) -> tuple[RunSpec, ReceivedClosure] | None:
    """Say the cell is done (``raised``: it failed, its report went first), then wait for the next cell:
    its spec and its closure (not loaded yet); None when the kernel let the ranks go."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the cell is over: a late interrupt is not for us
    startup.flush_output()
    _flush_c_output()
    reports.flush()
    reports.pause()
    try:
        inbox.send(CellDone(raised))
        frame = inbox.take(lambda frame: isinstance(frame, Spec))
        assert isinstance(frame, Spec)
        spec = outbox.here(frame.spec)
        # an InboxChannel reads as a PeerChannel does
        received = receive_closure(InboxChannel(inbox), keep_original=rank == 0, own_gpu=spec.device == "cuda")  # type: ignore[arg-type]  # duck-typed
    except Exception:  # noqa: BLE001 - the channel ended: the kernel let us go
        return None
    reports.resume()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the next cell may be interrupted
    return spec, received


def _flush_c_output() -> None:
    """What C code printed and its stdio still buffers (a C++ extension's ``printf``)."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass  # not a C library we can ask: Python's own output was flushed
