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
- DDP's gradient all-reduce, which its C++ reducer issues without Python: at a ``DistributedDataParallel``'s first
  forward, when no communication hook was registered and it all-reduces over the default group, taas registers
  :func:`timed_allreduce`, the same average (each bucket divided by the world's size, then summed) that DDP's
  built-in does, through the group's ``allreduce`` and a completion callback. A model with a hook of its own keeps
  it (its ``dist.*`` calls are timed as above; a built-in one, ``_register_builtin_comm_hook``, is not timed), and
  one over a group of its own is not timed.

On CUDA nothing is wrapped and no hook is registered: reading a collective's end on the host would wait for the GPU.
NCCL measures its own collectives on the GPU (``TORCH_NCCL_ENABLE_TIMING``, set in a CUDA rank's environment) and
reports each one's GPU time to a completion hook on its watchdog thread (``ProcessGroup._register_on_completion_hook``,
listed in taas_magic/private.py), registered on the default group when the health first finds it made.

Steps: each ``optimizer.step`` (a global post hook, ``register_optimizer_step_post_hook``); the reports thread adds the
``taas.report`` calls (the steps of a cell with no optimizer).
The cost when no collective runs: nothing; per collective, two clock reads and a lock (about a microsecond).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Any, Callable

# torch.distributed's functions that wait for other ranks (the object collectives call others; counted once)
# (FSDP2 calls all_gather_single and reduce_scatter_single; batch_isend_irecv's works are not timed)
WRAPPED = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_single",
           "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
           "barrier", "monitored_barrier", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send",
           "recv", "isend", "irecv", "all_gather_object", "broadcast_object_list", "gather_object",
           "scatter_object_list", "send_object_list", "recv_object_list")


class CollectiveClock:
    """Seconds with at least one collective in flight, overlapping ones counted once; and the steps taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight = 0
        self._since = 0.0  # when the collectives in flight started (the first of them)
        self._total = 0.0  # seconds in collectives, the ones in flight not yet counted
        self.gpu_seconds = 0.0  # NCCL's own measure, from its completion hook (CUDA ranks)
        self.steps = 0  # optimizer steps taken

    def begin(self) -> None:
        with self._lock:
            if not self._inflight:
                self._since = time.monotonic()
            self._inflight += 1

    def end(self, *_: Any) -> None:
        with self._lock:
            self._inflight -= 1
            if not self._inflight:
                self._total += time.monotonic() - self._since

    def seconds(self, now: float) -> float:
        """Seconds in collectives so far, the ones in flight up to ``now``."""
        with self._lock:
            return self._total + (now - self._since if self._inflight else 0.0) + self.gpu_seconds

    def step(self, *_: Any) -> None:
        self.steps += 1


clock = CollectiveClock()


def figures(now: float) -> dict:
    """What the rank's health carries for the straggler line (cumulative: the kernel takes differences)."""
    _hook_nccl_once()
    return {"collective": clock.seconds(now), "steps": clock.steps}


def install(cuda: bool, when_imported: Callable[[str, Callable], None]) -> None:
    """Time this rank's collectives from now on: on CPU, wrap torch.distributed's functions and DDP's reducer as
    each is first imported; on CUDA, NCCL's hook does (see the module docstring). Steps are counted on both."""
    global _cuda
    _cuda = cuda
    if cuda:
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # NCCL's process groups made from now on time on the GPU
    when_imported("torch.optim.optimizer", _count_steps)
    if not cuda:
        when_imported("torch.distributed", _wrap_distributed)
        when_imported("torch.nn.parallel.distributed", _time_ddp)


_cuda = False


def _count_steps(optimizer_module: Any) -> None:
    optimizer_module.register_optimizer_step_post_hook(clock.step)


def timed(function: Callable) -> Callable:
    """``function`` (a collective of torch.distributed) timed from its call to its completion here."""
    @functools.wraps(function)
    def collective(*args: Any, **kwargs: Any) -> Any:
        if _compiling():
            return function(*args, **kwargs)
        clock.begin()
        try:
            work = function(*args, **kwargs)
        except BaseException:
            clock.end()
            raise
        future = _future(work)  # an async op's (isend's, irecv's, async_op=True's); a synchronous one returns None
        if future is None:
            clock.end()
        else:
            future.then(clock.end)
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


def timed_allreduce(state: Any, bucket: Any) -> Any:
    """DDP's communication hook: its built-in average of a gradient bucket over the default group, timed to its
    completion here (no state: a model copied by pickling, as ``%taas heal`` does, holds no process group)."""
    group = sys.modules["torch.distributed"].group.WORLD
    buffer = bucket.buffer()
    buffer.div_(group.size())
    clock.begin()
    try:
        future = group.allreduce([buffer]).get_future()
    except BaseException:
        clock.end()
        raise
    return future.then(_ended_bucket)


def _ended_bucket(future: Any) -> Any:
    clock.end()
    return future.value()[0]


timed_allreduce.__annotations__ = {}  # DDP checks a hook's annotations against its own types: these are strings here


def _time_ddp(module: Any) -> None:
    """Each DistributedDataParallel made from now on: DDP's all-reduce timed from its first forward (see above)."""
    ddp = module.DistributedDataParallel
    made, builtin = ddp.__init__, ddp._register_builtin_comm_hook

    @functools.wraps(made)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self._taas_first_forward = self.register_forward_pre_hook(_first_forward)

    @functools.wraps(builtin)
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        self._taas_builtin_hook = True
        builtin(self, comm_hook_type)

    ddp.__init__, ddp._register_builtin_comm_hook = __init__, _register_builtin_comm_hook


def _first_forward(model: Any, _inputs: Any) -> None:
    model._taas_first_forward.remove()
    del model._taas_first_forward
    if model._comm_hooks or getattr(model, "_taas_builtin_hook", False) or _cuda:
        return  # the model's own hook stays (its dist.* calls are timed); CUDA: NCCL measures
    if model.process_group is not sys.modules["torch.distributed"].group.WORLD:
        return  # a group of its own: its all-reduce is not timed (the hook holds no group, see timed_allreduce)
    model.register_comm_hook(None, timed_allreduce)


_nccl_hooked = False


def _hook_nccl_once() -> None:
    """On CUDA, NCCL's completion hook on the default group once it is made (each collective's GPU time)."""
    global _nccl_hooked
    distributed = sys.modules.get("torch.distributed")
    if not _cuda or _nccl_hooked or distributed is None or not distributed.is_initialized():
        return
    _nccl_hooked = True
    try:
        if distributed.get_backend() == "nccl":
            distributed.group.WORLD._register_on_completion_hook(_nccl_done)  # private API: see taas_magic/private.py
    except Exception:  # noqa: BLE001 - no hook (an older NCCL build, another backend): no straggler line on this rank
        pass


def _nccl_done(info: Any) -> None:
    """NCCL's watchdog thread: one collective's GPU time (``active_duration``, measured with CUDA events)."""
    clock.gpu_seconds += info.active_duration.total_seconds()
