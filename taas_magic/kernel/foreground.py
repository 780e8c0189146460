"""The kernel's main thread while it waits for a run: the cell's output shown, the interrupt handled.

A run is supervised on its own thread (kernel/background.py); the cell that waits for it
(a foreground cell, ``%taas attach``, ``%taas wait``) shows the run's log in the cell as it
grows (output/cellstream.py) and returns when the run ends. Two ways to wait, one behaviour:

- :func:`wait_async`, for a taas cell the kernel runs as a coroutine (the input transformer
  makes it ``await`` this, cell/transformer.py): while it waits, the kernel's event loop is
  free, so ipykernel answers comm messages (a reloaded page restoring the run's live widget
  and asking for its backlog) in the middle of the cell. The log wakes it as soon as an
  entry arrives (``call_soon_threadsafe``), so nothing waits for a poll.
- :func:`wait_blocking`, where the cell cannot be a coroutine (``%autoawait off``,
  ``run_cell_magic`` called from code): the same, polling the log.

What an interrupt of the waiting cell means is the caller's ``on_interrupt``: ``STOP`` (a
foreground cell: the stop ladder and the autopsy, then the error ``KeyboardInterrupt``,
exactly as before), or ``LEAVE`` (``attach``, ``wait``: the run goes on, the cell stops
waiting). While a stop is under way a second interrupt changes nothing.
"""

from __future__ import annotations

import asyncio

from taas_magic.kernel.background import RunThread
from taas_magic.output.cellstream import CellStream

POLL_SECONDS = 0.02  # the blocking wait's poll: the relay's own flush interval
STOP, LEAVE = "stop", "leave"


def wait_blocking(run: RunThread, shown: CellStream | None, on_interrupt: str = STOP) -> None:
    """Show ``run``'s log in this cell until the run ends (see the module docstring)."""
    try:
        while not run.join(POLL_SECONDS):
            _show(shown)
    except KeyboardInterrupt:
        if on_interrupt == LEAVE:
            _show(shown)
            raise
        _stop_and_show(run, shown)
    _show(shown)
    if shown is not None:
        shown.finish()


def _stop_and_show(run: RunThread, shown: CellStream | None) -> None:
    run.stop()
    while not run.done:
        try:
            run.join(POLL_SECONDS)
            _show(shown)
        except KeyboardInterrupt:
            continue  # a second interrupt: the stop ladder is already running


async def wait_async(run: RunThread, shown: CellStream | None, on_interrupt: str = STOP) -> None:
    """:func:`wait_blocking` as a coroutine: the kernel's event loop runs while it waits."""
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def wake() -> None:  # from the run's thread, after each entry
        loop.call_soon_threadsafe(woken.set)

    unlisten = run.log.listen(wake)
    run.when_done(wake)
    try:
        while not run.done:
            _show(shown)
            woken.clear()
            if run.done:
                break
            waiter = asyncio.ensure_future(woken.wait())
            try:  # not wait_for: on Python 3.11 it can swallow a cancellation that meets a wake-up
                await asyncio.wait({waiter}, timeout=0.25)
            finally:
                waiter.cancel()
    except (asyncio.CancelledError, KeyboardInterrupt):  # ipykernel turns the interrupt into a cancellation
        if on_interrupt == LEAVE:
            _show(shown)
            raise KeyboardInterrupt from None
        _stop_and_show(run, shown)
    finally:
        unlisten()
    _show(shown)
    if shown is not None:
        shown.finish()


def _show(shown: CellStream | None) -> None:
    if shown is not None:
        shown.show_new()
