"""The one supervision loop: a cell's ranks started or reused, watched through each attempt, and what a
failure costs left to a policy of their rank set.

Runs in the kernel, on the run's own thread (kernel/runs/background.py), which is the one thread that sends
a cell's frames to its ranks and reads what they say (supervisor.py routes it).

As torch's elastic agent's ``_invoke_run`` over its ``WorkerGroup``: the loop knows nothing of selectors or
frames; it drives a :class:`Supervised` (supervisor.py) through each attempt, and asks a :class:`Policy` the
four questions whose answers differ with how long the ranks live::

    group = policy.start(attempt)        new processes (attempt n: TORCHELASTIC_RESTART_COUNT=n), or the kept ones
    attach(group, running)               running() once every rank has connected
    watch()                              the outcome, or None: it failed (the verdict says how)
      an interrupt -> policy.interrupted the person's: never retried; do the ranks outlive it?
      a failure    -> policy.failed      the root cause as the cell shows it; restart, or raise it
    policy.attempt_over(group, outlived) always: the group closed, or kept for the next cell

The two policies are ``--restarts`` (restarts.py's :class:`Restarting`: a failed attempt's ranks are stopped
and new ones start, as torchrun's) and ``--keep`` (keptcell.py's :class:`Keeping`: the ranks outlive the
cell, a failure is the cell's, and they are stopped only when they cannot all end it, as IPython keeps a
kernel). :class:`AttemptWatch` steps the supervisor through one attempt, until it ends, fails, times out or
is stopped; :func:`run_ranks` is the whole: the data workers, the supervisor, the loop, and always the close.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from taas_magic.errors import RunError, TrialPruned
from taas_magic.kernel.supervision.dataplane import DataPlane
from taas_magic.kernel.supervision.mux import Mux
from taas_magic.kernel.supervision.supervisor import RunOutcome, RunParts, Supervisor
from taas_magic.kernel.supervision.verdict import TimedOut, Verdict
from taas_magic.launch.contract import ProcessGroup
from taas_magic.output.relay import OutputRelay

POLL_SECONDS = 0.05
COURIER_POLL_SECONDS = 0.005
PIPE_GRACE_SECONDS = 2.0  # after every rank ended its cell, how long to wait for the end of its output


class Supervised(Protocol):
    """What the loop and its policies drive (supervisor.py's :class:`Supervisor`; recording stand-ins in the unit
    tests)."""

    relay: OutputRelay
    verdict: Verdict

    def show_start(self) -> None: ...

    def attach(self, group: ProcessGroup, running: Callable[[], None]) -> None: ...

    def watch(self) -> RunOutcome | None: ...

    def pump(self, seconds: float) -> None: ...

    def explain_stop(self, autopsy: bool = True) -> None: ...

    def last_words(self, notes: tuple[str, ...]) -> RunError: ...

    def stop_everything(self, group: ProcessGroup, graceful: bool = True) -> None: ...

    def detach(self) -> None: ...


@dataclass(frozen=True)
class Judged:
    """A failed attempt as its policy judged it: the error the cell shows, whether another attempt follows, and
    whether the ranks outlive the attempt (kept ranks that all ended their cell)."""

    failure: RunError
    restart: bool = False
    outlived: bool = False


class Policy(Protocol):
    """What a failure, an interrupt and an attempt's end cost the ranks (restarts.py, keptcell.py)."""

    clean_exit: str | None  # what a rank's exit with code 0 is: None, its cell's end; else the failure (verdict.py)

    def mux(self, parts: RunParts) -> Mux:
        """The selector watching the ranks: a new one, or the kept ranks' (its peers and frames this cell's)."""

    def start(self, supervisor: Supervised, attempt: int) -> ProcessGroup:
        """Attempt ``attempt``'s ranks, their displays shown in their place."""

    def running(self, attempt: int) -> Callable[[], None]:
        """Called once every rank of the attempt has connected."""

    def interrupted(self, supervisor: Supervised, group: ProcessGroup) -> bool:
        """The person's interrupt (or ``%taas stop``): said where the ranks are, ``group.interrupt`` (a signal for a
        cell's own ranks, a frame for kept ones: the group the policy started is which); whether they outlive it."""

    def failed(self, supervisor: Supervised, group: ProcessGroup, attempt: int, previous: RunError | None) -> Judged:
        """The attempt failed (``supervisor.verdict.failure``; ``previous``: the attempt before's, if it failed)."""

    def attempt_over(self, supervisor: Supervised, group: ProcessGroup, outlived: bool) -> None:
        """Always, after each attempt: its ranks closed, or (``outlived``) kept."""

    def close(self) -> None:
        """The run's end, after the supervisor's: the selector closed, or kept with the ranks."""


def run(supervisor: Supervised, policy: Policy) -> RunOutcome:
    """Attempts until one succeeds (its outcome) or a failure is not followed by another (raised)."""
    previous: RunError | None = None
    for attempt in itertools.count():
        group = policy.start(supervisor, attempt)
        outlived = False
        try:
            supervisor.attach(group, policy.running(attempt))
            try:
                outcome = supervisor.watch()
            except KeyboardInterrupt:
                outlived = policy.interrupted(supervisor, group)
                raise
            if outcome is not None:
                outlived = True
                return outcome
            judged = policy.failed(supervisor, group, attempt, previous)
            outlived = judged.outlived
            if not judged.restart:
                raise judged.failure
            previous = judged.failure
        finally:
            policy.attempt_over(supervisor, group, outlived)
    raise AssertionError("unreachable: the loop returns or raises")


def run_ranks(parts: RunParts, policy: Policy, data: Callable[[], DataPlane] | None = None) -> RunOutcome:
    """The cell's data workers (``data()``, if any), then its ranks as ``policy`` gives them, supervised until they
    end it; whatever happens, no rank or worker outlives the call unless the policy keeps the ranks."""
    mux = policy.mux(parts)
    try:
        plane = data() if data is not None else None
    except BaseException:
        policy.close()
        raise
    supervisor = Supervisor(parts, plane, mux, watch, policy.clean_exit)
    try:
        return run(supervisor, policy)
    finally:
        supervisor.close()
        policy.close()


def watch(supervisor: Supervisor) -> RunOutcome | None:
    """One attempt of ``supervisor``'s ranks watched (:class:`AttemptWatch`)."""
    return AttemptWatch(supervisor).run()


class AttemptWatch:
    """One attempt watched: the supervisor stepped until every rank ended its cell or it failed, within
    ``--timeout`` (which does not count the time a rank waits at a pdb prompt), a stop asked (``%taas stop``, an
    interrupt, raised as ``KeyboardInterrupt``), or a search's pruner's say."""

    def __init__(self, supervisor: Supervisor):
        self.supervisor = supervisor
        self.timeout = supervisor.parts.timeout
        self.deadline = None if self.timeout is None else time.monotonic() + self.timeout
        if supervisor.parts.hang is not None:
            supervisor.parts.hang.forget()  # an attempt's ranks say their own waits

    def run(self) -> RunOutcome | None:
        """The outcome, or None: it failed (the verdict says how). An interrupt propagates (its policy says where
        the ranks were)."""
        try:
            return self._loop()
        except KeyboardInterrupt:
            self.supervisor.relay.flush(force=True)
            raise

    def _loop(self) -> RunOutcome | None:
        supervisor, verdict = self.supervisor, self.supervisor.verdict
        ended_at: float | None = None
        before = time.monotonic()
        while True:
            supervisor.step(self._wait())
            if self.deadline is not None and supervisor.debugging.in_pdb:
                self.deadline += time.monotonic() - before
            before = now = time.monotonic()
            if verdict.failure is not None:
                supervisor.settle()
                return None
            if verdict.ranks_exited():  # every rank ended its cell: once what it printed is read, that is the outcome
                ended_at = ended_at or now
                if supervisor.output_read() or now - ended_at > PIPE_GRACE_SECONDS:
                    return supervisor.outcome()  # (past the grace: something the cell started holds a pipe open)
            if supervisor.parts.stop_asked():
                raise KeyboardInterrupt  # as the person's interrupt
            if supervisor.parts.prune_asked():
                self._pruned()
            self._say_if_hung(now)
            if self.deadline is not None and now >= self.deadline:
                assert self.timeout is not None  # a deadline exists only with a timeout
                running, lines = supervisor.autopsy()
                verdict.saw(TimedOut(self.timeout, running, tuple(lines)))
                return None

    def _say_if_hung(self, now: float) -> None:
        """The hang line when one is due (autopsy/hangline.py): where every rank is, and nothing stopped."""
        supervisor, hang = self.supervisor, self.supervisor.parts.hang
        if hang is None or supervisor.group is None or (waited := hang.due(now, bool(supervisor.debugging.in_pdb))) is None:
            return
        running = supervisor.verdict.running()
        supervisor.relay.notice(hang.line(supervisor.group.stacks(running), running, supervisor.parts.ids.ranks, waited))

    def _wait(self) -> float:
        """How long the next select may wait: until a flush, the deadline, or a courier's copies."""
        now = time.monotonic()
        wait = min(POLL_SECONDS, self.supervisor.relay.seconds_until_flush(now))
        if self.deadline is not None:
            wait = min(wait, max(0.0, self.deadline - now))
        data = self.supervisor.data
        if data is not None and data.courier is not None and data.courier.busy:
            wait = min(wait, COURIER_POLL_SECONDS)  # its copies complete off the selector
        return wait

    def _pruned(self) -> None:
        """A search's pruner stopped this trial: every rank at once (TERM, then KILL), no autopsy, so its GPUs go to
        the next trial now."""
        self.supervisor.relay.mute()
        if self.supervisor.group is not None:
            self.supervisor.group.stop(graceful=False)
        raise TrialPruned("taas: the search's pruner stopped this trial")
