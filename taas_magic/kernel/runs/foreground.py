"""The kernel's main thread while it waits for a run: the cell's output shown, the interrupt handled.

Runs in the kernel, on the cell's thread (its main thread), while the run goes on its own thread.

A run is supervised on its own thread (kernel/runs/background.py); the cell that waits for it
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

While it waits, the cell is the run's console (kernel/supervision/prompts.py): a rank's pdb prompt is
shown and read here, through ``input()`` (ipykernel's ``input_request``, as IPython's own pdb).
``q`` or an interrupt at a prompt stops the run, whichever cell waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from typing import Callable, Iterator

from IPython.core.error import StdinNotImplementedError

from taas_magic.kernel.runs.background import RunThread
from taas_magic.kernel.supervision.prompts import QUIT_COMMANDS, Console
from taas_magic.output.cellstream import CellStream

POLL_SECONDS = 0.02  # the blocking wait's poll: the relay's own flush interval
# the coroutine's longest sleep between the log's wake-ups where a signal cannot wake the event loop (see
# _signals_wake_the_loop): how late the person's interrupt can be seen there
INTERRUPT_SECONDS = 0.05
QUIET_SECONDS = 0.25  # the same where a signal wakes the loop
STOP, LEAVE = "stop", "leave"


def wait_blocking(run: RunThread, shown: CellStream | None, on_interrupt: str = STOP,
                  console: Console | None = None) -> None:
    """Show ``run``'s log in this cell until the run ends (see the module docstring); ``console``:
    the one opened for this cell before the run started (a foreground cell), else one is opened now."""
    try:
        with consoling(run, console) as opened:
            while not run.join(POLL_SECONDS):
                _show(shown)
                serve_prompts(run, shown, opened)
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


async def wait_async(run: RunThread, shown: CellStream | None, on_interrupt: str = STOP,
                     console: Console | None = None) -> None:
    """:func:`wait_blocking` as a coroutine: the kernel's event loop runs while it waits."""
    loop = asyncio.get_running_loop()
    woken = asyncio.Event()

    def wake() -> None:  # from the run's thread, after each entry
        loop.call_soon_threadsafe(woken.set)

    unlisten = run.log.listen(wake)
    run.when_done(wake)
    opened = _open(run, console, wake)
    woken_by_signals = _signals_wake_the_loop(loop)
    sleep = QUIET_SECONDS if woken_by_signals is not None else INTERRUPT_SECONDS
    try:
        while not run.done:
            _show(shown)
            serve_prompts(run, shown, opened)
            woken.clear()
            if run.done:
                break
            waiter = asyncio.ensure_future(woken.wait())
            try:  # not wait_for: on Python 3.11 it can swallow a cancellation that meets a wake-up
                await asyncio.wait({waiter}, timeout=sleep)
            finally:
                waiter.cancel()
    except (asyncio.CancelledError, KeyboardInterrupt):  # ipykernel turns the interrupt into a cancellation
        if on_interrupt == LEAVE:
            _show(shown)
            raise KeyboardInterrupt from None
        _stop_and_show(run, shown)
    finally:
        if woken_by_signals is not None:
            woken_by_signals()
        unlisten()
        _close(run, opened, wake)
    _show(shown)
    if shown is not None:
        shown.finish()


def _signals_wake_the_loop(loop: asyncio.AbstractEventLoop) -> Callable[[], None] | None:
    """While a cell waits: a signal wakes the kernel's event loop at once (Python's wakeup fd, read by the loop),
    so the person's interrupt is seen now. ipykernel's SIGINT handler runs only when the main thread runs Python,
    and a signal taken by another of the kernel's threads does not wake the loop's select: it waited for the next
    wake-up (a kept cell's interrupt took 0.3 s). The undo, or None where the main thread cannot take the wakeup
    fd (another thread's loop, or someone else's fd is set: it is left alone)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def drain() -> None:
        with contextlib.suppress(OSError):
            while os.read(read_end, 512):
                pass

    def undo(reading: bool = True) -> None:
        signal.set_wakeup_fd(-1)
        if reading:
            loop.remove_reader(read_end)
        os.close(read_end)
        os.close(write_end)

    try:
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter's main thread after all
        previous = None
    if previous != -1:  # someone else's fd (left as it was), or none could be set
        if previous is not None:
            signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        return None
    try:
        loop.add_reader(read_end, drain)
    except (NotImplementedError, RuntimeError):  # a loop that watches no file descriptors: it polls instead
        undo(reading=False)
        return None
    return undo


def open_console(run: RunThread) -> Console | None:
    """Before a foreground run starts: its cell is its console from the first moment (a breakpoint
    reached before the cell begins to wait still prompts)."""
    return run.prompts.open_console() if run.prompts is not None else None


@contextlib.contextmanager
def consoling(run: RunThread, console: Console | None = None) -> Iterator[Console | None]:
    """This cell is ``run``'s console while it waits (``console``: one opened already)."""
    opened = _open(run, console)
    try:
        yield opened
    finally:
        _close(run, opened)


def _open(run: RunThread, console: Console | None, wake: Callable[[], None] | None = None) -> Console | None:
    if run.prompts is None:
        return None
    if wake is not None:
        run.prompts.wake_consoles.append(wake)
    return console or run.prompts.open_console()


def _close(run: RunThread, console: Console | None, wake: Callable[[], None] | None = None) -> None:
    if run.prompts is None or console is None:
        return
    if wake is not None:
        run.prompts.wake_consoles.remove(wake)
    run.prompts.close_console(console)


def serve_prompts(run: RunThread, shown: CellStream | None, console: Console | None) -> None:
    """The ranks' prompts waiting for this cell, one after the other: pdb's text, then the person's line.
    ``q`` or an interrupt at the prompt stops the run (the cell goes on waiting for it to end)."""
    desk = run.prompts
    if desk is None or console is None:
        return
    while console.stdin and not desk.quit_asked and (asked := desk.next_prompt()) is not None:
        rank, prompt, text = asked
        _show(shown)  # what the run showed before, then pdb's text: in order, above the prompt
        print(text, end="", flush=True)
        if run.done:
            return  # it ended meanwhile (another rank failed): no prompt for a rank that is gone
        try:
            line = _read_line(prompt.prompt)
        except StdinNotImplementedError:
            desk.refused(console, rank, prompt)
            return
        except (KeyboardInterrupt, EOFError):
            line = "q"
        if line.strip() in QUIT_COMMANDS and not prompt.post_mortem:  # after a post-mortem the rank reports its error
            desk.quit()
            run.stop()
            return
        desk.answer(rank, line, prompt.prompt)


def _read_line(prompt: str) -> str:
    """``input(prompt)``: ipykernel's ``input_request``. An interrupt meanwhile raises ``KeyboardInterrupt``
    here: while a coroutine cell runs, ipykernel's own SIGINT handler only schedules a cancellation on
    the event loop, which this blocking read holds, so Python's default handler is put back for the read."""
    if threading.current_thread() is not threading.main_thread():
        return input(prompt)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return input(prompt)
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def _show(shown: CellStream | None) -> None:
    if shown is not None:
        shown.show_new()
