"""DDP's gradient all-reduce, timed by DDP's own C++ timer: a CPU rank's waiting in DDP, for the straggler line.

Runs in each rank whose device is the CPU: installed with the collectives' timing (output/collectives.py), read on
the cell's thread after a step (rank/steps.py's listeners; ``taas.report`` on the cell's thread, for a cell with no
optimizer), its total read with the rank's health on the reports thread.

DDP's reducer issues its all-reduce in C++, without Python. DDP times its own iterations (its runtime logging, one
iteration in 100 by default, and every one of the first ten): when the forward starts, the backward's compute starts,
the first bucket's all-reduce starts, the last gradient is ready (the backward's compute ends), and every bucket's
all-reduce has completed (``_get_ddp_logging_data``). The time a rank *waits* is the last span, from its last
gradient to its last bucket's completion: the all-reduce's exposed tail. A fast rank reaches it early and waits there
for the slow one; the all-reduce that overlaps the backward's compute is not waiting (``backward_comm_time`` counts
it: 14 of a 1-rank step's 18 ms backward read as waiting).

- **Where it is read.** DDP reads and writes these figures under its reducer's mutex, which it holds while the
  backward waits for its buckets: read from another thread, the reports thread blocked for as long as a peer was
  late (3.5 s), and the rank sent no health meanwhile. So they are read on the cell's thread, after an optimizer
  step (the backward is over), at most every :data:`READ_EVERY` seconds; each model's latest sampled iteration is
  counted for every iteration since the last one counted: a sample per reading, not a sum of every step.
- **Which samples.** DDP's figures are of the latest sampled iteration, and a grad-enabled forward without a backward
  is an iteration too: its forward's time beside an older backward's. A sample counts only when its forward is later
  than the last counted one's and its events are in order (:data:`EVENTS`).
- **How often.** A sampled iteration costs DDP tens of microseconds, more with more parameter tensors (it joins
  every gradient's index into a string). Each model's sample rate is set, on the cell's thread between steps, to
  about one sample every :data:`SAMPLE_EVERY` seconds of its steps, never rarer than DDP's own default: a step of
  100 ms or more is sampled every step; one of a millisecond, as DDP does without taas.
- **What is not.** A model with a Python communication hook is timed by the ``dist.*`` calls its hook makes (not
  twice); a hook that calls a group's methods directly is not timed. A model under compiled autograd's Python reducer
  is not timed (DDP's timer does not see it). While a rank has joined (``Join``, uneven inputs), its shadow
  all-reduces are timed as a collective each (:func:`install`).
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

READ_EVERY = 0.25  # seconds between readings of the models' samples (the health goes every 2 s)
SAMPLE_EVERY = 0.1  # seconds of steps between two sampled iterations of a model
DDP_SAMPLE_RATE = 100  # DDP's own: one iteration in 100 (kDDPRuntimeLoggingSampleRate)
EVENTS = ("forward_compute_time_start", "backward_compute_time_start", "backward_comm_time_start",
          "backward_compute_time_end", "backward_comm_time_end")  # in this order in a sample of one iteration


@dataclass
class _Sampled:
    """What was last counted of one model (all on the cell's thread)."""

    reducer: Any  # the reducer it was counted from (heal makes a new one, counting from iteration 0)
    iteration: int = 0  # DDP's number of the last sample counted
    forward: int = 0  # its forward's start (DDP's clock, ns)
    rate: int = DDP_SAMPLE_RATE
    read_at: float = 0.0  # when it was last read, and DDP's iteration then: the model's time per iteration
    read_iteration: int = -1


class DdpTimes:
    """Seconds the rank's DDP models waited in their gradient all-reduce (see the module docstring)."""

    def __init__(self) -> None:
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Sampled
        self.seconds = 0.0  # written on the cell's thread only; the reports thread reads it
        self._due = 0.0

    def add(self, model: Any) -> None:
        """A DDP model made (or rebuilt by unpickling: heal's new reducer) on this rank."""
        self._models[model] = _Sampled(reducer=getattr(model, "reducer", None))

    def leave(self, model: Any) -> None:
        """``model`` left to DDP's own logging (its default rate, never read): its all-reduce is not timed."""
        self._models.pop(model, None)

    def after_step(self) -> None:
        """After an optimizer step or a ``taas.report``: on the cell's thread (the rank's main thread), where no
        backward is under way, read the models' samples when a reading is due."""
        now = time.monotonic()
        if now < self._due or threading.get_ident() != _CELLS:
            return
        self._due = now + READ_EVERY
        for model, sampled in list(self._models.items()):
            self._read(model, sampled, now)

    def _read(self, model: Any, sampled: _Sampled, now: float) -> None:
        if model._comm_hooks or getattr(model, "_use_python_reducer", False):
            return  # a Python hook's dist.* calls are timed (output/collectives.py); compiled autograd's: not timed
        reducer = getattr(model, "reducer", None)
        if reducer is not sampled.reducer:  # heal rebuilt it: its iterations count from 0 again
            sampled = self._models[model] = _Sampled(reducer=reducer)
        try:
            data = model._get_ddp_logging_data()  # private API: see taas_magic/private.py
        except Exception:  # noqa: BLE001 - a DDP without its logger (another torch): its all-reduce is not timed
            return
        iteration = int(data.get("iteration", 0))
        if iteration <= sampled.iteration:
            return  # no new sample since the last counted
        self._pace(model, sampled, iteration, now)
        forward, compute, first, last_gradient, done = (int(data.get(name, -1)) for name in EVENTS)
        if not sampled.forward < forward <= compute <= min(first, last_gradient) <= max(first, last_gradient) <= done:
            return  # not one iteration's events (a forward without a backward), or counted already
        self.seconds += (done - last_gradient) / 1e9 * (iteration - sampled.iteration)
        sampled.iteration, sampled.forward = iteration, forward

    def _pace(self, model: Any, sampled: _Sampled, iteration: int, now: float) -> None:
        """The model's sample rate, from its time per iteration since the last reading (see the module docstring)."""
        if sampled.read_iteration >= 0 and iteration > sampled.read_iteration:
            per_iteration = (now - sampled.read_at) / (iteration - sampled.read_iteration)
            rate = max(1, min(DDP_SAMPLE_RATE, int(SAMPLE_EVERY / max(per_iteration, 1e-9))))
            if rate != sampled.rate:
                try:
                    model._set_ddp_runtime_logging_sample_rate(rate)  # private API: see taas_magic/private.py
                    sampled.rate = rate
                except Exception:  # noqa: BLE001 - kept at DDP's own rate
                    pass
        sampled.read_at, sampled.read_iteration = now, iteration


times = DdpTimes()
_CELLS = threading.main_thread().ident  # the thread a rank runs its cells on (rank/main.py)


def install(ddp_module: Any, collective: Callable[[Callable], Callable]) -> None:
    """Each DistributedDataParallel made from now on, or rebuilt by unpickling (``%taas heal``), is timed by its own
    timer; a joined rank's shadow all-reduces (``Join`` with uneven inputs) are timed by ``collective`` (the
    collectives' timing wrapper)."""
    ddp = ddp_module.DistributedDataParallel
    made, rebuilt = ddp.__init__, ddp.__setstate__

    @functools.wraps(made)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        times.add(self)

    @functools.wraps(rebuilt)
    def __setstate__(self: Any, state: Any) -> None:
        rebuilt(self, state)
        times.add(self)

    ddp.__init__, ddp.__setstate__ = __init__, __setstate__
    shadow = getattr(ddp, "_match_all_reduce_for_bwd_pass", None)  # private API: see taas_magic/private.py
    if shadow is not None:
        ddp._match_all_reduce_for_bwd_pass = collective(shadow)
