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
- DDP's gradient all-reduce, which its C++ reducer issues without Python: by DDP's own timer, read on the cell's
  thread after its steps (output/ddptiming.py). No communication hook is registered: a person's is DDP's own.

On CUDA nothing is wrapped and DDP's timer is not read: reading a collective's end on the host would wait for the GPU.
NCCL measures its own collectives on the GPU (``TORCH_NCCL_ENABLE_TIMING``, set in a CUDA rank's environment) and
reports each one's GPU time to a completion hook on its watchdog thread (``ProcessGroup._register_on_completion_hook``,
listed in taas_magic/private.py), registered on the default group when the health first finds it made.

Steps: :meth:`CollectiveClock.step`, at each step rank/steps.py counts (the outermost ``optimizer.step`` of the cell's
first optimizer); the reports thread adds the ``taas.report`` calls (the steps of a cell with no optimizer).
The cost when no collective runs: nothing; per collective, two clock reads and a lock (about a microsecond); DDP's
per step: output/ddptiming.py.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Any, Callable

from taas_magic.output import ddptiming

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
    return {"collective": clock.seconds(now) + ddptiming.times.seconds, "steps": clock.steps}


def install(cuda: bool, when_imported: Callable[[str, Callable], None]) -> None:
    """Time this rank's collectives from now on: on CPU, wrap torch.distributed's functions and DDP's reducer as
    each is first imported; on CUDA, NCCL's hook does (see the module docstring)."""
    global _cuda
    _cuda = cuda
    if cuda:
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # NCCL's process groups made from now on time on the GPU
    if not cuda:
        when_imported("torch.distributed", _wrap_distributed)
        when_imported("torch.nn.parallel.distributed", functools.partial(ddptiming.install, collective=timed))


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
