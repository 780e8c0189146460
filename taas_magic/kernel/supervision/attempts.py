"""The attempts of one run: start the ranks, supervise them, and after a failure either start
them all again or raise the failure, as ``--restarts`` allows (restarts.py says which).

Runs in the kernel, on the run's own thread (kernel/runs/background.py), with the supervisor.

As torch's elastic agent's ``_invoke_run``: the loop knows nothing of selectors or frames; it
drives a :class:`Supervised` (kernel/supervision/supervisor.py) through each attempt::

    group = start(attempt)               fresh processes; attempt n sees TORCHELASTIC_RESTART_COUNT=n
    attach(group, running)               running() once every rank has connected
    watch()                              the outcome, or None: it failed (the verdict says how)
    refusal -> last_words(notes)         the root cause as the cell shows it, built whole
      refused: stop everything, raise    every rank gracefully, and the data workers
      else:    stop the group at once    the next attempt starts from the checkpoint, not their finally
    detach(); group.close()              always, whatever happened in the attempt
    between(attempt); the restart line   only after a failed attempt that is followed by another

An interrupt is the person's: it propagates from ``watch`` and is never retried.
"""

from __future__ import annotations

import functools
from typing import Callable, Protocol, TypeVar

from taas_magic.errors import RunError
from taas_magic.kernel.supervision.restarts import Attempts, restart_line
from taas_magic.kernel.supervision.verdict import Verdict
from taas_magic.launch.contract import ProcessGroup
from taas_magic.output.relay import OutputRelay

Outcome = TypeVar("Outcome")
Outcome_co = TypeVar("Outcome_co", covariant=True)


class Supervised(Protocol[Outcome_co]):
    relay: OutputRelay
    verdict: Verdict

    def attach(self, group: ProcessGroup, running: Callable[[], None]) -> None: ...

    def watch(self) -> Outcome_co | None: ...

    def last_words(self, notes: tuple[str, ...]) -> RunError: ...

    def stop_everything(self, group: ProcessGroup) -> None: ...

    def detach(self) -> None: ...


def run(supervisor: Supervised[Outcome], start: Callable[[int], ProcessGroup], attempts: Attempts) -> Outcome:
    """Attempts until one succeeds (its outcome) or a failure is not restarted (raised)."""
    previous: RunError | None = None
    for attempt in range(attempts.restarts + 1):
        outcome, previous = _attempt(supervisor, start(attempt), attempt, attempts, previous)
        if outcome is not None:
            return outcome
        assert previous is not None  # a failed attempt that was not refused
        attempts.between(attempt)
        for line in previous.notes:
            supervisor.relay.notice(line)  # a timed-out attempt: where its ranks were
        supervisor.relay.notice(restart_line(attempt, attempts.restarts, previous))
    raise AssertionError("unreachable: the last attempt returns or raises")


def _attempt(supervisor: Supervised[Outcome], group: ProcessGroup, attempt: int, attempts: Attempts,
             previous: RunError | None) -> tuple[Outcome | None, RunError | None]:
    """One attempt: its outcome, or its failure when another attempt follows (else the failure is raised)."""
    try:
        supervisor.attach(group, functools.partial(attempts.running, attempt < attempts.restarts))
        outcome = supervisor.watch()
        if outcome is not None:
            return outcome, previous
        reason = supervisor.verdict.refusal(attempt, attempts.restarts, previous)
        failure = supervisor.last_words((f"taas: {reason}",) if reason else ())
        if reason is not None:
            supervisor.stop_everything(group)
            raise failure
        group.stop(graceful=False)  # the next attempt starts from the checkpoint, not from their finally
        return None, failure
    finally:
        supervisor.detach()
        group.close()
