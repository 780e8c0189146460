"""Spares warmed while a run runs, on a thread of their own (launch/local/backend.py's ``standby``).

Runs in the kernel, on a helper thread of its own (``taas-standby``), started and settled from the
run's own thread.

Why a thread: asking the spare factory for forks takes 20 to 40 ms here, and the supervisor
asks the moment the last rank connects, when rank 0's first line is about to arrive; done on
the supervisor's thread, it held that line back by as much (a warm DDP cell's first line went
from 0.038 to 0.077 s when spares started to be forked during runs).

Why a delay for the next cell's spares: a fork and the spare it becomes take CPU while the
ranks make their process group, which on a host whose ranks use every core slows the cell's
start. There the next cell's spares are made ``NEXT_CELL_DELAY`` seconds into the run (a run
that ends sooner has them made when it ends, as before); where the ranks leave cores idle (a
GPU host), at once. Spares for a restart (``--restarts``) are
made at once: a rank may die at any moment.

:meth:`Standby.settle` waits for what was started (a restart takes those spares; the run's
end refills after them) and raises what the fill raised, where the run can report it.
"""

from __future__ import annotations

import threading
from typing import Callable

NEXT_CELL_DELAY = 1.0  # seconds after the last rank connected


class Standby:
    """At most one fill under way; :meth:`settle` cancels one still waiting for its delay."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, fill: Callable[[], None], delay: float) -> None:
        self._cancel.clear()
        self._thread = threading.Thread(target=self._run, args=(fill, delay), name="taas-standby", daemon=True)
        self._thread.start()

    def _run(self, fill: Callable[[], None], delay: float) -> None:
        if delay and self._cancel.wait(delay):
            return  # the run ended (or restarts) first: whoever settled fills what it needs
        try:
            fill()
        except BaseException as exc:  # noqa: BLE001 - raised again by settle(), on the run's thread
            self._error = exc

    def settle(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._cancel.set()
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
