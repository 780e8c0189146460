"""How every process the kernel starts begins and ends: a rank, a warm spare, a data worker.

Runs in each rank, spare and data worker, on its main thread, first thing and last.

The kernel (or a host's agent) writes a ``wire.Handshake`` line, ``HOST PORT KEY``, and a
``wire.Placement`` line (its peer id, its name, its write rule) on the process's stdin, which
then stays open as its lifeline; a warm spare gets one more line between the two, the
settings of the launch that takes it (spare.py). :func:`begin` then, in this order, because
each step needs the one before:

0. makes SIGINT raise ``KeyboardInterrupt`` whatever the process inherited (:func:`interruptible`);
1. forks the watchdog while the process is single-threaded (lifeline.py);
2. reads the handshake (a spare first imports torch, then waits here) and its placement;
3. applies the write rule when its placement has one (a private layer over the
   repository: before any thread starts, since ``unshare`` needs a single thread); on a
   host that does not see the notebook's repository, rank 0 too, and what is the
   repository's is sent to the kernel as the rank ends (writes/outbox.py);
4. holds the lifeline and dies with its parent (and, as a child subreaper, keeps what
   the cell starts among its descendants even when it leaves the session: finish ends them);
5. connects to the kernel and proves the key (wire.py), as peer ``peer_id``; the channel
   then carries the typed frames of protocol.py.

:func:`finish` flushes, reaps the watchdog and leaves with ``os._exit``, so no atexit
hook or non-daemon thread of the cell can hang the run. The key never enters the
environment (the cell's own subprocesses inherit that), nor does anything else of the run.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

from taas_magic import protocol, wire
from taas_magic.rank import lifeline


def isolate_writes(repository: str, layer: str, write_mode: str | None, who: str) -> None:
    """Divert this process's writes under the repository (overlay, else Python-level)."""
    from taas_magic.writes import divert

    if write_mode == "overlay":
        from taas_magic.writes.namespace import IsolationUnavailable, divert_writes

        try:
            divert_writes(repository, layer, in_namespace=spare_namespace())
            return
        except IsolationUnavailable as exc:  # the probe passed, this repository did not
            print(f"taas: {who} could not mount the overlay over {repository} ({exc}); "
                  "its writes there are diverted by Python instead", file=sys.stderr, flush=True)
    divert.install(repository, layer)


def spare_namespace() -> bool:
    """Whether this process is a GPU spare that entered its namespaces before its CUDA context (spare.py)."""
    spare = sys.modules.get("taas_magic.rank.spare")
    return bool(spare is not None and spare.namespace_ready)


def begin(*, spare: bool = False) -> protocol.PeerChannel:
    """Steps 0 to 5 above; the connected, authenticated channel to the kernel."""
    interruptible()
    lifeline.start_watchdog()  # first, while single-threaded: see lifeline.py
    lifeline.adopt_orphans()
    if spare:
        from taas_magic.rank import spare as spare_start

        spare_start.warm_up(spare_start.bound_gpu(sys.argv))  # imports now, then waits (single-threaded) for a cell
    parent = os.getppid()
    handshake = wire.Handshake.parse(lifeline.read_first_line())
    if spare:
        spare_start.adopt(lifeline.read_first_line())
    place = wire.Placement.parse(lifeline.read_first_line())
    if place.layer and place.repository:
        isolate_writes(place.repository, place.layer, place.write_mode, place.who)
    if place.away:  # a host that does not see the notebook's repository: what is its, sent as the rank ends
        from taas_magic.writes import outbox

        outbox.enter(place)
    if spare:
        spare_start.use_launch_threads()
    lifeline.hold_lifeline()
    lifeline.die_with_parent(parent)
    return protocol.PeerChannel(wire.BlockingChannel.connect(handshake.host, handshake.port, handshake.key, place.peer_id))


def interruptible() -> None:
    """SIGINT raises ``KeyboardInterrupt``, as in a terminal, whatever this process inherited: a process a Ray worker
    starts has it blocked (Ray's threads block it) and one started as a background job has it ignored, which Python
    keeps; the kernel's interrupt (the stop ladder's first step, a cell's ``finally``) would then do nothing."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    signal.signal(signal.SIGINT, signal.default_int_handler)


def flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def finish(code: int) -> NoReturn:
    """Flush, reap the watchdog, end what the cell started, and exit now with ``code``."""
    flush_output()
    lifeline.end_watchdog()
    lifeline.kill_descendants()
    os._exit(code)
