"""``%debug`` (and ``%taas debug [RUN]``) after a run whose rank raised: that rank's traceback with
the locals of each frame, as the rank captured them when it failed.

Runs in the kernel, on the cell's thread.

The rank is gone by then (every rank is stopped when one fails), so there is no live frame to
step through: the rank sent, with its error, each frame's place and the ``repr`` of its locals
(rank/cellpdb.py ``frames_with_locals``, each cut to 200 characters). For a live prompt at
the failing frame, IPython's own ``%pdb on`` makes the failing rank wait there (rank/cellpdb.py).

``%debug`` stays IPython's for everything else: after a cell whose error is not a rank's, or
with arguments (``%debug CODE``, ``%debug --breakpoint``), IPython's own magic runs.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from taas_magic.errors import PeerFailed
from taas_magic.kernel.runs.background import Runs

LIVE_HINT = ("taas: for a live prompt at the failing frame, run %pdb on and run the cell again: the failing "
             "rank stops there, the cell opens pdb on it, and the other ranks wait until you leave it")


def rank_failure(error: object) -> PeerFailed | None:
    return error if isinstance(error, PeerFailed) and error.peer.is_rank else None


def last_cell_error() -> BaseException | None:
    """The error the last failing cell showed (IPython keeps it as ``sys.last_value``; ``sys.last_exc`` on 3.12)."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def show(error: PeerFailed) -> None:
    """The failing rank's traceback, then each captured frame with its locals, then how to get a live prompt."""
    print(f"taas: rank {error.peer.index} on {error.host} {error.summary}")
    if error.traceback_text:
        print(error.traceback_text.rstrip())
    frames = error.what.frames
    if frames:
        print("\nLocals of each frame, as the rank had them when it raised (their repr):")
    for place, line, function, names in frames:
        print(f"{place}, line {line}, in {function}")
        if not names:
            print("    (no locals)")
        width = max((len(name) for name in names), default=0)
        for name, text in names.items():
            print(f"    {name:<{width}} = {text}")
    print(LIVE_HINT)


def taas_debug(runs: Runs, given: str | None) -> None:
    """``%taas debug [RUN]``: the run's failing rank (the newest run that has one, without RUN)."""
    if given:
        error = rank_failure(runs.find(given, "%taas debug").error)
        if error is None:
            raise UsageError(f"taas: run {given} did not end with a rank's error; %taas runs lists how each ended")
    else:
        failed = [rank_failure(run.error) for run in runs.all()]
        error = next((each for each in reversed(failed) if each is not None), None) or rank_failure(last_cell_error())
        if error is None:
            raise UsageError("taas: no run of this kernel ended with a rank's error, so there is no rank to debug")
    show(error)


def no_ipython_post_mortem(shell: InteractiveShell) -> None:
    """With ``%pdb on``, IPython opens its debugger on a failing cell's traceback: for a taas cell those
    are the kernel's own frames, and the rank's prompt (rank/cellpdb.py) was the post-mortem. Off for
    this cell's error, back on once the cell is over."""
    if not getattr(shell, "call_pdb", False):
        return
    shell.call_pdb = False

    def back_on(*_: object) -> None:
        shell.call_pdb = True
        shell.events.unregister("post_execute", back_on)

    shell.events.register("post_execute", back_on)  # after the traceback was shown; silent executes too


def wrap_ipython_debug(shell: InteractiveShell) -> Callable[[], None]:
    """``%debug`` with no arguments after a taas cell whose rank raised shows that rank (:func:`show`);
    IPython's own ``%debug`` otherwise. Returns what puts IPython's back (the extension's unload)."""
    original = shell.find_line_magic("debug")
    if original is None:
        return lambda: None

    def debug(line: str = "") -> Any:
        error = rank_failure(last_cell_error())
        if error is not None and not line.strip():
            show(error)
            return None
        return original(line)

    debug.__doc__ = original.__doc__
    shell.register_magic_function(debug, "line", "debug")  # type: ignore[arg-type]  # IPython's decorator types are too narrow

    def put_back() -> None:
        # IPython has no API to unregister a magic (private API: see taas_magic/private.py)
        if shell.magics_manager.magics["line"].get("debug") is debug:
            shell.magics_manager.magics["line"]["debug"] = original

    return put_back
