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
  step or a report (the backward is over), at most every :data:`READ_EVERY` seconds. A cell that trains on a thread
  of its own is not timed.
- **What a sample counts for.** DDP keeps only its latest sampled iteration. Each new one stands for the iterations
  since the last one seen: its tail times their number, at most the seconds since (a sample, not a sum of every
  step). DDP counts a grad-enabled forward without a backward (an evaluation without ``no_grad``) as an iteration:
  its sample has that forward beside an older backward's events, is not counted, and stands for iterations without
  an all-reduce. A sample counts only when its events are one iteration's, in order (:data:`EVENTS`), and not the
  last one's again.
- **How often.** A sampled iteration costs DDP tens of microseconds, more with more parameter tensors (it joins
  every gradient's index into a string). Each model's next sampled iteration is set, on the cell's thread between
  steps, at random up to about :data:`SAMPLE_EVERY` seconds of its steps away and never rarer than DDP's own
  default: DDP samples the iterations its rate divides, and a fixed rate saw a stall every 100 steps on another rank
  at every sample (18.9 s counted for 1.4 s of stalls) or never, by the stall's phase alone.
- **What it holds.** The tail also holds DDP's copy of the averaged buckets into ``.grad`` (with DDP's default
  ``gradient_as_bucket_view=False``): on every rank alike, about a tenth of a lone rank's backward for a 34M-parameter
  MLP.
- **What is not.** A model with a Python communication hook is timed by the ``dist.*`` calls its hook makes (not
  twice), from its first bucket's all-reduce to its last one's completion, the overlapped compute included; a hook
  that calls a group's or the reducer's methods directly (DDP's ``mixed_precision``) is not timed. A model under
  compiled autograd's Python reducer is not timed (DDP's timer does not see it). While a rank has joined (``Join``,
  uneven inputs), its shadow all-reduces are timed as a collective each (:func:`install`).
"""

from __future__ import annotations

import functools
import os
import random
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

READ_EVERY = 0.25  # seconds between readings of the models' samples (a reading sees the latest; each stands for all since)
SAMPLE_EVERY = 0.1  # seconds of steps between two sampled iterations of a model
DDP_SAMPLE_RATE = 100  # DDP's own: one iteration in 100 (kDDPRuntimeLoggingSampleRate)
# a sampled iteration's events (DDP's clock, ns): its forward, its backward's first gradient, its first bucket's
# all-reduce and its last gradient (in either order), every bucket completed
EVENTS = ("forward_compute_time_start", "backward_compute_time_start", "backward_comm_time_start",
          "backward_compute_time_end", "backward_comm_time_end")


@dataclass
class _Sampled:
    """What was last seen of one model's samples (all on the cell's thread)."""

    seen_at: float  # when its last sample was seen (monotonic)
    seen: int = 0  # DDP's number of that sample's iteration
    forward: int = -1  # its forward's start (DDP's clock): the same start again is the same sample, not a new one


class DdpTimes:
    """Seconds the rank's DDP models waited in their gradient all-reduce (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # models are added on any thread (a DDP made or unpickled), read on the cell's
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _Sampled
        self.seconds = 0.0  # written on the cell's thread only; the reports thread reads it
        self._due = 0.0
        self._draw = random.Random()  # the sampled iterations' spacing (never the person's random state)

    def add(self, model: Any) -> None:
        """A DDP model made, or rebuilt by unpickling (heal's new reducer counts its iterations from 0 again)."""
        with self._lock:
            self._models[model] = _Sampled(time.monotonic())

    def leave(self, model: Any) -> None:
        """``model`` left to DDP's own logging (its default rate, never read): its all-reduce is not timed."""
        with self._lock:
            self._models.pop(model, None)

    def after_step(self) -> None:
        """After an optimizer step or a ``taas.report``: on the cell's thread (the rank's main thread), where no
        backward is under way, read the models' samples when a reading is due."""
        now = time.monotonic()
        if now < self._due or threading.get_ident() != _CELLS:
            return
        self._due = now + READ_EVERY
        with self._lock:
            models = list(self._models.items())
        for model, sampled in models:
            self._read(model, sampled, now)

    def _read(self, model: Any, sampled: _Sampled, now: float) -> None:
        if model._comm_hooks or getattr(model, "_use_python_reducer", False):
            return  # a Python hook's dist.* calls are timed (output/collectives.py); compiled autograd's: not timed
        try:
            data = model._get_ddp_logging_data()  # private API: see taas_magic/private.py
        except Exception:  # noqa: BLE001 - a DDP without its logger (another torch): its all-reduce is not timed
            return
        iteration = int(data.get("iteration", 0))
        if iteration <= sampled.seen:
            return  # no new sample
        # the sample stands for the iterations since the last one seen: counted if it is one iteration's events
        # (one without a backward, such as an evaluation with gradients, stands for iterations with no all-reduce)
        span, elapsed = iteration - sampled.seen, now - sampled.seen_at
        forward, compute, first, last_gradient, done = (int(data.get(name, -1)) for name in EVENTS)
        if forward != sampled.forward and 0 <= forward <= compute <= min(first, last_gradient) <= max(
                first, last_gradient) <= done:
            self.seconds += min((done - last_gradient) / 1e9 * span, elapsed)
        sampled.seen, sampled.seen_at, sampled.forward = iteration, now, forward
        self._pace(model, elapsed / span)

    def _pace(self, model: Any, per_iteration: float) -> None:
        """The model's next sampled iteration: about :data:`SAMPLE_EVERY` seconds of its steps away, drawn at random
        up to that (DDP samples the iterations whose number its rate divides: a fixed rate would always see, or
        never see, a stall that comes every so many steps). Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` DDP logs each
        sampled iteration: its own rate is kept."""
        if _DETAIL:
            return
        rate = max(1, min(DDP_SAMPLE_RATE, int(SAMPLE_EVERY / max(per_iteration, 1e-9))))
        try:
            model._set_ddp_runtime_logging_sample_rate(self._draw.randint((rate + 1) // 2, rate))  # private API
        except Exception:  # noqa: BLE001 - kept at its rate (see taas_magic/private.py)
            pass


times = DdpTimes()
_DETAIL = os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
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
