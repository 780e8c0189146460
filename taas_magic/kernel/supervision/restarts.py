"""``--restarts K``: which failures start the ranks again, and what the cell says when they do.

Runs in the kernel, on the run's own thread (kernel/runs/background.py); the rule is a pure
function.

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

from dataclasses import dataclass, field
from typing import Callable

from taas_magic.errors import PeerFailed, RunError, RunTimeout


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
