"""The rank's half of the straggler line: how much of its time the rank spends in collectives, and its steps.

Runs in each rank: installed on its main thread (rank/main.py, once per rank), the clock advanced on whichever thread
starts or ends a collective (the cell's, autograd's, gloo's completion threads; NCCL's watchdog), read on the reports
thread with the rest of the rank's health (output/reports.py; the kernel's half: output/straggler.py, output/board.py).

*In a collective* means: from the moment this rank starts one until it completes here, overlapping ones counted once
(a bucket's all-reduce running while the next bucket's gradients are computed is still time in a collective). A fast
rank reaches each collective first and is in it until the slow rank arrives; the slow rank finds them waiting and is
in it only for the transfer. The kernel compares the ranks' shares (output/straggler.py).

What is timed, on a rank whose device is the CPU (gloo):

- every collective the cell, a library or taas calls through ``torch.distributed`` (``all_reduce``, ``all_gather``,
  ``all_gather_single`` and ``reduce_scatter_single`` as FSDP2 calls them, ``broadcast``, ``barrier``, the object
  collectives, point to point): the module's functions are wrapped; a synchronous call is timed to its return, an
  ``async_op=True`` one until its work's future completes (a callback on gloo's thread). While torch.compile traces,
  the wrapper is the function itself (nothing to trace);
- DDP's gradient all-reduce, which its C++ reducer issues without Python: from DDP's own timer, which each DDP model
  made on the rank runs at every iteration (:class:`DdpTimes`: its latest step's all-reduce time, read with the
  rest of the rank's health, counted for every step since the last reading). No communication hook is registered:
  a person's own (PowerSGD, fp16 compression) is DDP's as without taas, its ``dist.*`` calls timed as above; a
  built-in one is timed by DDP's timer.

On CUDA nothing is wrapped and no hook is registered: reading a collective's end on the host would wait for the GPU.
NCCL measures its own collectives on the GPU (``TORCH_NCCL_ENABLE_TIMING``, set in a CUDA rank's environment) and
reports each one's GPU time to a completion hook on its watchdog thread (``ProcessGroup._register_on_completion_hook``,
listed in taas_magic/private.py), registered on the default group when the health first finds it made.

Steps: :meth:`CollectiveClock.step`, at each step rank/steps.py counts (the outermost ``optimizer.step`` of the cell's
first optimizer); the reports thread adds the ``taas.report`` calls (the steps of a cell with no optimizer).
The cost when no collective runs: nothing; per collective, two clock reads and a lock (about a microsecond); per DDP
step, DDP's own statistics (about 10 µs a step, bench/steptiming.py).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable

# torch.distributed's functions that wait for other ranks (the object collectives call others; counted once)
# (FSDP2 calls all_gather_single and reduce_scatter_single; batch_isend_irecv's works are not timed)
WRAPPED = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
           "all_gather_coalesced", "_broadcast_coalesced", "reduce_scatter", "reduce_scatter_tensor",
           "reduce_scatter_single", "broadcast", "barrier", "monitored_barrier", "reduce", "gather", "scatter",
           "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "all_gather_object",
           "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list", "recv_object_list")


class CollectiveClock:
    """Seconds with at least one collective in flight, overlapping ones counted once; and the steps taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cell = 0  # which cell the collectives in flight began in (a kept rank's cells, numbered)
        self._inflight = 0
        self._since = 0.0  # when the collectives in flight started (the first of them)
        self._total = 0.0  # seconds in collectives, the ones in flight not yet counted
        self.gpu_seconds = 0.0  # NCCL's own measure, from its completion hook (CUDA ranks)
        self.steps = 0  # optimizer steps taken

    def begin(self) -> int:
        """A collective starts; what :meth:`end` is given when it ends."""
        with self._lock:
            if not self._inflight:
                self._since = time.monotonic()
            self._inflight += 1
            return self._cell

    def end(self, cell: int, *_: Any) -> None:
        with self._lock:
            if cell != self._cell:
                return  # began in an earlier cell, whose collectives in flight were forgotten
            self._inflight -= 1
            if not self._inflight:
                self._total += time.monotonic() - self._since

    def new_cell(self) -> None:
        """A cell starts: an async collective of the last one that never completed is no longer in flight."""
        with self._lock:
            if self._inflight:
                self._total += time.monotonic() - self._since
            self._cell, self._inflight = self._cell + 1, 0

    def seconds(self, now: float) -> float:
        """Seconds in collectives so far, the ones in flight up to ``now``."""
        with self._lock:
            return self._total + (now - self._since if self._inflight else 0.0) + self.gpu_seconds

    def step(self) -> None:
        self.steps += 1


clock = CollectiveClock()


def figures(now: float) -> dict:
    """What the rank's health carries for the straggler line (cumulative: the kernel takes differences); no
    collective time from a CUDA rank whose NCCL hook is not in place (yet, or at all): it would read 0 waiting."""
    _hook_nccl_once()
    if _cuda and not _nccl_hooked:
        return {"steps": clock.steps}
    return {"collective": clock.seconds(now) + ddp_times.seconds(), "steps": clock.steps}


def install(cuda: bool, when_imported: Callable[[str, Callable], None]) -> None:
    """Time this rank's collectives from now on: on CPU, wrap torch.distributed's functions and DDP's reducer as
    each is first imported; on CUDA, NCCL's hook does (see the module docstring)."""
    global _cuda
    _cuda = cuda
    if cuda:
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # NCCL's process groups made from now on time on the GPU
    if not cuda:
        when_imported("torch.distributed", _wrap_distributed)
        when_imported("torch.nn.parallel.distributed", _time_ddp)


_cuda = False


def timed(function: Callable) -> Callable:
    """``function`` (a collective of torch.distributed) timed from its call to its completion here."""
    @functools.wraps(function)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if _compiling():
            return function(*args, **kwargs)
        cell = clock.begin()
        try:
            work = function(*args, **kwargs)
        except BaseException:
            clock.end(cell)
            raise
        future = _future(work)  # an async op's (async_op=True's); a synchronous one, and gloo's isend/irecv, None
        if future is None:
            clock.end(cell)
        else:
            future.then(functools.partial(clock.end, cell))
        return work

    collective.__taas_timed__ = function  # type: ignore[attr-defined]  # a mark on the wrapper: it is ours, and what it wraps
    return collective


def _future(work: Any) -> Any:
    """The future of an async collective's work (None: not one, or it has none: it counts as over at its return)."""
    try:
        return work.get_future() if hasattr(work, "get_future") else None
    except (RuntimeError, NotImplementedError):
        return None


def _compiling() -> bool:
    compiler = getattr(sys.modules.get("torch"), "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())


def _wrap_distributed(distributed: Any) -> None:
    """Every collective of ``torch.distributed`` (and its ``distributed_c10d``, which the object collectives call)."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    for name in WRAPPED:
        function = getattr(distributed, name, None)
        if function is None or hasattr(function, "__taas_timed__"):
            continue
        wrapped = timed(function)
        setattr(distributed, name, wrapped)
        if c10d is not None and getattr(c10d, name, None) is function:
            setattr(c10d, name, wrapped)


class DdpTimes:
    """The seconds DDP's reducers spend all-reducing gradients, from DDP's own C++ timer (no Python in the step).

    Each DDP model made on this rank records its runtime statistics at every iteration
    (``_set_ddp_runtime_logging_sample_rate(1)``; DDP's default samples one in 100): among them, the latest
    iteration's ``backward_comm_time``, from its first bucket's all-reduce to the end of the backward's wait for the
    last. Read on the reports thread (``_get_ddp_logging_data``, which releases the GIL), each model adds that time
    once for every iteration since the last read: a sample of one step in each reading, not a sum of every step.
    A model with a Python communication hook is left to the wrapped ``dist.*`` calls its hook makes (counted once),
    and one under compiled autograd's Python reducer is not timed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> the iteration read last
        self._seconds = 0.0

    def add(self, model: Any) -> None:
        """``model`` (a DDP just made, or rebuilt by unpickling) records its statistics at every iteration."""
        try:
            model._set_ddp_runtime_logging_sample_rate(1)  # private API: see taas_magic/private.py
        except Exception:  # noqa: BLE001 - a DDP without it (another torch): its all-reduce is not timed
            return
        with self._lock:
            self._models[model] = 0  # a rebuilt reducer counts its iterations from 0 again

    def seconds(self) -> float:
        """Seconds in DDP's all-reduce so far (estimated from each reading's latest step, as above)."""
        with self._lock:
            models = list(self._models.items())
        for model, seen in models:
            if model._comm_hooks or getattr(model, "_use_python_reducer", False):
                continue  # its hook's dist.* calls are timed; compiled autograd's reducer is not
            try:
                data = model._get_ddp_logging_data()  # private API: see taas_magic/private.py
            except Exception:  # noqa: BLE001 - a model being rebuilt (no logger for a moment): read next time
                continue
            iteration, latest = int(data.get("iteration", 0)), int(data.get("backward_comm_time", 0))
            if iteration > seen and latest > 0:
                self._seconds += latest / 1e9 * (iteration - seen)
            with self._lock:
                if model in self._models:
                    self._models[model] = iteration
        return self._seconds


ddp_times = DdpTimes()


def _time_ddp(module: Any) -> None:
    """Each DistributedDataParallel made from now on, or rebuilt by unpickling (``%taas heal``), is timed by its own
    statistics (:class:`DdpTimes`)."""
    ddp = module.DistributedDataParallel
    made, rebuilt = ddp.__init__, ddp.__setstate__

    @functools.wraps(made)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        ddp_times.add(self)

    @functools.wraps(rebuilt)
    def __setstate__(self: Any, state: Any) -> None:
        rebuilt(self, state)
        ddp_times.add(self)

    ddp.__init__, ddp.__setstate__ = __init__, __setstate__


_nccl_tried = False
_nccl_hooked = False  # NCCL's completion hook is in: this CUDA rank's collectives are timed


def _hook_nccl_once() -> None:
    """On CUDA, NCCL's completion hook on the default group once it is made (each collective's GPU time)."""
    global _nccl_tried, _nccl_hooked
    distributed = sys.modules.get("torch.distributed")
    if not _cuda or _nccl_tried or distributed is None or not distributed.is_initialized():
        return
    _nccl_tried = True
    try:
        if distributed.get_backend() == "nccl":
            distributed.group.WORLD._register_on_completion_hook(_nccl_done)  # private API: see taas_magic/private.py
            _nccl_hooked = True
    except Exception:  # noqa: BLE001 - no hook (an older NCCL build, another backend): no straggler line on this rank
        pass


def _nccl_done(info: Any) -> None:
    """NCCL's watchdog thread: one collective's GPU time (``active_duration``, measured with CUDA events)."""
    clock.gpu_seconds += info.active_duration.total_seconds()
