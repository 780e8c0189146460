"""Restart-on-failure, the policy of one cell's ranks (``--restarts K``): which failures start them again, and what
the cell says when they do.

Runs in the kernel, on the run's own thread (kernel/runs/background.py), as a :class:`Policy` of the one loop
(attempts.py); the rule (:func:`refusal`) is a pure function. A failed attempt's ranks are stopped at once (TERM,
then KILL: the next attempt starts from the checkpoint, not from their ``finally``), what they left is swept,
and new ones start; a failure that is not restarted stops every rank gracefully (INT first) and is raised; an
interrupt says where each rank was (the autopsy) and stops them. Each attempt's group is closed as it ends.

As torchrun's elastic agent (``--max-restarts``) and Ray Train's ``FailureConfig(max_failures)``:
when an attempt fails, every rank of it is stopped and all of them start again, fresh
processes, up to K times; every rank sees ``TORCHELASTIC_RESTART_COUNT`` (the attempt) and
``TORCHELASTIC_MAX_RESTARTS`` (K). Where we differ, on purpose:

- the same Python exception (its type, at the same innermost notebook line) in two attempts
  in a row is a deterministic bug: it is not retried again (torchrun would spend all K);
- a data worker's failure is not retried: it is the loader raising, or its host gone, and
  starting the ranks again cannot fix either (the workers outlive a rank restart, so the
  elements they prepared are served again from their cache);
- an interrupt is the person's: it stops everything and never restarts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

from taas_magic.errors import PeerFailed, RunError, RunTimeout
from taas_magic.kernel.supervision.attempts import Judged, Supervised
from taas_magic.kernel.supervision.mux import Mux
from taas_magic.kernel.supervision.supervisor import RunParts
from taas_magic.launch.contract import ProcessGroup


def _nothing(*_: object) -> None:
    return None


@dataclass(frozen=True)
class Attempts:
    """How many times a failed run starts again, and what happens around each attempt."""

    restarts: int = 0
    between: Callable[[int], None] = field(default=_nothing)  # attempt n failed and its processes are gone
    # every rank of an attempt has connected; True when a failure would start the ranks again
    running: Callable[[bool], None] = field(default=_nothing)


def how(failure: RunError) -> str:
    """The failure in a few words: ``rank 1 was killed by SIGKILL``, ``--timeout 5s passed``."""
    if isinstance(failure, PeerFailed) and failure.peer.is_rank:
        return f"{failure.peer} {failure.summary.removesuffix(' without reporting an error')}"
    if isinstance(failure, RunTimeout):
        running = ", ".join(map(str, failure.running)) or "none"
        return f"--timeout {failure.timeout:g}s passed (ranks still running: {running})"
    return str(failure)


def refusal(attempt: int, restarts: int, failure: RunError, previous: RunError | None) -> str | None:
    """Why attempt ``attempt`` (0-based) is not followed by another (empty: nothing to say, as
    with --restarts 0), or None: restart."""
    if not restarts:
        return ""
    if isinstance(failure, PeerFailed) and not failure.peer.is_rank:
        return "a data worker's failure is not restarted (the docs' Restarts and checkpoints page says why)"
    if attempt >= restarts:
        return f"all {restarts} restart{'s' if restarts != 1 else ''} (--restarts {restarts}) were used"
    if (
        isinstance(failure, PeerFailed) and isinstance(previous, PeerFailed)
        and failure.signature is not None and failure.signature == previous.signature
    ):
        kind, _, line = failure.signature
        return (f"the error repeated: the same {kind} at line {line} in attempts {attempt} and {attempt + 1}, "
                "so it was not restarted again")
    return None


def restart_line(attempt: int, restarts: int, failure: RunError) -> str:
    """What the cell shows when attempt ``attempt`` (0-based) failed and the next one starts."""
    return (f"taas: attempt {attempt + 1} of {restarts + 1} failed: {how(failure)}; "
            f"restarting every rank (attempt {attempt + 2} of {restarts + 1})")


class Restarting:
    """The policy of one cell's ranks (attempts.py's :class:`Policy`): ``start(attempt)`` makes each attempt's, and
    a failure starts them all again as ``attempts`` allows."""

    clean_exit: str | None = None  # a rank's exit with 0 is the end of its cell

    def __init__(self, start: Callable[[int], ProcessGroup], attempts: Attempts | None = None):
        self._start, self.attempts = start, attempts or Attempts()
        self._mux: Mux | None = None
        self._restart: tuple[int, RunError] | None = None  # the failed attempt, once judged to be restarted

    def mux(self, parts: RunParts) -> Mux:
        self._mux = Mux(parts.server, parts.ids, parts.greeting)
        return self._mux

    def start(self, supervisor: Supervised, attempt: int) -> ProcessGroup:
        if not attempt:
            supervisor.show_start()
        return self._start(attempt)

    def running(self, attempt: int) -> Callable[[], None]:
        return functools.partial(self.attempts.running, attempt < self.attempts.restarts)

    def interrupted(self, supervisor: Supervised, group: ProcessGroup) -> bool:
        """Where they are first (the autopsy), then SIGINT: each cell's ``finally`` runs within the stop ladder's first
        grace, which sends no second SIGINT (:meth:`attempt_over` closes the group)."""
        supervisor.explain_stop()
        group.interrupt(supervisor.verdict.running())
        return False

    def failed(self, supervisor: Supervised, group: ProcessGroup, attempt: int, previous: RunError | None) -> Judged:
        assert supervisor.verdict.failure is not None, "only a failed attempt is judged"
        reason = refusal(attempt, self.attempts.restarts, supervisor.verdict.failure, previous)
        failure = supervisor.last_words((f"taas: {reason}",) if reason else ())
        if reason is not None:
            supervisor.stop_everything(group)
            return Judged(failure)
        group.stop(graceful=False)  # the next attempt starts from the checkpoint, not from their finally
        self._restart = (attempt, failure)
        return Judged(failure, restart=True)

    def attempt_over(self, supervisor: Supervised, group: ProcessGroup, outlived: bool) -> None:
        """The attempt's ranks forgotten and their group closed; before a restart, what they left swept and the
        restart line said."""
        try:
            supervisor.detach()
        finally:
            group.close()
        if self._restart is not None:
            (attempt, failure), self._restart = self._restart, None
            self.attempts.between(attempt)
            for line in failure.notes:
                supervisor.relay.notice(line)  # a timed-out attempt: where its ranks were
            supervisor.relay.notice(restart_line(attempt, self.attempts.restarts, failure))

    def close(self) -> None:
        if self._mux is not None:
            self._mux.close()
