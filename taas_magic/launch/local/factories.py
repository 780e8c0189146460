"""The spare pool's factories: the one that forks its spares, the one warming torch's compiler to serve next,
and the retired ones until they leave.

Runs in the kernel, under the spare pool's lock (launch/local/spares.py), on whichever thread uses the pool.

A factory (launch/local/sparefactory.py) fixes what a spare fixes when it imports (:func:`frozen_settings`):
it serves while the kernel's values are the ones it started under, and is retired (it leaves once its last
spare has ended) when they change or the spares are turned off. Once the session's ranks compiled
(``torch.compile``), :meth:`Factories.compiles` starts a factory that also imports torch's compiler and probes
the CPU for it (rank/factory.py's ``warm_compiler``) beside the one that serves; :meth:`Factories.promote`
makes it the one that serves once it is ready (the pool then replaces the old one's spares with its forks).
"""

from __future__ import annotations

import os
import time

from taas_magic.launch.local.sparefactory import SpareFactory
from taas_magic.launch.rankenv import visible_gpu_count

# One thread while importing, so the spare stays single-threaded (rank/spare.py).
SINGLE_THREADED = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
FROZEN_PREFIXES = ("CUDA_", "PYTORCH_", "CUBLAS_", "TORCH_")  # read once, when torch or CUDA starts


def frozen_settings() -> dict[str, str]:
    """The kernel's variables a spare fixes when it imports torch and starts CUDA."""
    return {name: value for name, value in os.environ.items() if name.startswith(FROZEN_PREFIXES)}


def new_factory(step: bool, compiler: bool = False) -> SpareFactory | None:
    """A factory starting now (None: it could not start; spares start as fresh interpreters)."""
    try:
        return SpareFactory({**os.environ, **SINGLE_THREADED}, frozen_settings(), step, compiler)
    except OSError:
        return None


class Factories:
    """The factory that serves (``current``), the compiler's coming one, and the retired ones."""

    def __init__(self) -> None:
        self.current: SpareFactory | None = None  # forks the spares once it has imported
        self.upcoming: SpareFactory | None = None  # warming torch's compiler, until it serves
        self.retired: list[SpareFactory] = []  # until the spares they forked have ended
        self.compiling = False  # the session's ranks compiled: factories warm torch's compiler from now on

    def for_spares(self, step: bool) -> SpareFactory | None:
        """The factory for spares started now: the running one while it serves the kernel's frozen
        settings, else a new one (the old one retired)."""
        self.release_retired()
        current = self.current
        if current is not None and not (current.serves(frozen_settings()) and current.alive()):
            self.retire()
            current = None
        if current is None:
            current = self.current = new_factory(step, self.compiling)
        return current

    def serving(self) -> SpareFactory | None:
        """The factory, if it can fork for a launch now or once it has imported (alive, not
        retired, under the kernel's frozen settings); none is started here."""
        factory = self.current
        return factory if factory is not None and factory.serves(frozen_settings()) else None

    def forks_ready(self) -> bool:
        """Whether a spare started now is a fork of a ready factory (milliseconds, no import), not a
        fresh interpreter (seconds of CPU for its imports)."""
        factory = self.current
        if factory is None:
            return False
        factory.collect()  # it says "ready" once, when its imports are done
        return factory.ready and factory.serves(frozen_settings())

    def compiles(self) -> None:
        """The session's ranks compiled: a factory that warms torch's compiler starts beside the one that
        serves (seconds of CPU, once a session), which goes on serving until it is ready."""
        if self.compiling:
            return
        self.compiling = True
        if self.current is not None and not self.current.compiler:
            self.upcoming = new_factory(visible_gpu_count() == 0, compiler=True)

    def promote(self) -> bool:
        """Whether the compiler's factory took over just now (ready: the one that served is retired); one
        that failed is ended, and the one that serves goes on."""
        upcoming = self.upcoming
        if upcoming is None:
            return False
        upcoming.collect()
        if upcoming.ready and upcoming.serves(frozen_settings()) and upcoming.alive():
            self.upcoming = None
            self.retire()
            self.current = upcoming
            return True
        if upcoming.broken or not upcoming.alive() or not upcoming.serves(frozen_settings()):
            self.upcoming = None
            upcoming.end_unused()
        return False

    def state(self) -> str:
        """What ``%taas status`` says of them, after the spares."""
        if self.current is None:
            return ""
        said = (" with their factory (ready: new spares are forks)" if self.forks_ready() else
                " with their factory (still importing: new spares start fresh)")
        upcoming = self.upcoming
        if self.current.compiler:
            return said + ", torch's compiler warmed in it"
        if upcoming is not None:
            upcoming.collect()
            return said + (", and one with torch's compiler warmed, whose forks replace these spares at the next cell"
                           if upcoming.ready else ", and one warming torch's compiler (this session compiles)")
        return said

    def pids(self) -> list[int]:
        return [factory.process.pid for factory in (self.current, self.upcoming) if factory is not None]

    def retire(self) -> None:
        """The serving factory forks no more; it is kept until it has left (the spares it forked have ended)."""
        if self.current is not None:
            self.current.retire()
            self.retired.append(self.current)
            self.current = None

    def close(self, wait: float) -> None:
        """The compiler's coming one ended, the serving one retired, and the retired ones that leave within
        ``wait`` seconds reaped."""
        if self.upcoming is not None:
            upcoming, self.upcoming = self.upcoming, None
            upcoming.end_unused()
        self.retire()
        self.release_retired(wait=wait)

    def release_retired(self, wait: float = 0.0) -> None:
        """Reap the retired factories that have left (within ``wait`` seconds), closing their pipe and socket."""
        deadline = time.monotonic() + wait
        while True:
            for gone in [old for old in self.retired if not old.alive()]:
                gone.collect()  # its last exit reports are kept for the runs that still poll those ranks
                gone.close()
                self.retired.remove(gone)
            if not self.retired or time.monotonic() >= deadline:
                return
            time.sleep(0.01)
