"""While a taas cell waits, a signal wakes the kernel's event loop at once (kernel/runs/foreground.py).

ipykernel's SIGINT handler runs only when the main thread runs Python. A signal another thread takes
does not wake the main thread's select; the wakeup fd does. Here the main thread blocks the signal, so
the kernel delivers it to another thread, as it may in a kernel: the loop, sleeping 5 s, must still run
the handler at once. And the wakeup fd is given back, and left alone where someone else holds it.
"""

import asyncio
import os
import signal
import threading
import time

from taas_magic.kernel.runs.foreground import _signals_wake_the_loop


def test_a_signal_taken_by_another_thread_wakes_the_loop_and_its_handler_runs_at_once():
    loop = asyncio.new_event_loop()
    heard: list[float] = []
    done = asyncio.Event()

    def handler(*_: object) -> None:
        heard.append(time.monotonic())
        loop.call_soon_threadsafe(done.set)

    previous = signal.signal(signal.SIGUSR1, handler)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # this thread never takes it
    undo = _signals_wake_the_loop(loop)
    try:
        assert undo is not None
        sent: list[float] = []

        def send() -> None:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})  # a new thread inherits the main's mask
            time.sleep(0.2)
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGUSR1)  # taken by this thread, the only one that does not block it

        sender = threading.Thread(target=send)
        sender.start()

        async def sleep_until_heard() -> None:
            try:  # one long wait: only the wakeup fd lets the handler run before it times out
                await asyncio.wait_for(done.wait(), 5)
            except asyncio.TimeoutError:
                pass

        loop.run_until_complete(sleep_until_heard())
        sender.join()
        assert heard, "the handler never ran"
        assert heard[0] - sent[0] < 2.5, "the loop slept through the signal"  # 5 s without the wakeup fd
    finally:
        if undo is not None:
            undo()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
        signal.signal(signal.SIGUSR1, previous)
        loop.close()
    assert signal.set_wakeup_fd(-1) == -1  # given back


def test_someone_elses_wakeup_fd_is_left_alone():
    loop = asyncio.new_event_loop()
    read_end, write_end = os.pipe2(os.O_NONBLOCK)
    signal.set_wakeup_fd(write_end)
    try:
        assert _signals_wake_the_loop(loop) is None
        assert signal.set_wakeup_fd(write_end) == write_end
    finally:
        signal.set_wakeup_fd(-1)
        os.close(read_end)
        os.close(write_end)
        loop.close()
