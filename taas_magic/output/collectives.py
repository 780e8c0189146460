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
  built-in does, through the group's ``allreduce`` and a completion callback. A model with a hook of its own before
  its first forward keeps it (its ``dist.*`` calls are timed as above; a built-in one, ``_register_builtin_comm_hook``,
  is not timed); one registered after it is called by taas's (a built-in one as its Python twin), and timed so; one
  over a group of its own is not timed.

On CUDA nothing is wrapped and no hook is registered: reading a collective's end on the host would wait for the GPU.
NCCL measures its own collectives on the GPU (``TORCH_NCCL_ENABLE_TIMING``, set in a CUDA rank's environment) and
reports each one's GPU time to a completion hook on its watchdog thread (``ProcessGroup._register_on_completion_hook``,
listed in taas_magic/private.py), registered on the default group when the health first finds it made.

Steps: :meth:`CollectiveClock.step`, at each step rank/steps.py counts (the outermost ``optimizer.step`` of the cell's
first optimizer); the reports thread adds the ``taas.report`` calls (the steps of a cell with no optimizer).
The cost when no collective runs: nothing; per collective, two clock reads and a lock (about a microsecond).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from dataclasses import dataclass
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
    return {"collective": clock.seconds(now), "steps": clock.steps}


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


@dataclass
class Delegate:
    """The state taas's DDP hook is registered with: the hook a person registers after it, which it then calls
    (picklable with the model: ``%taas heal`` copies models; it holds no process group)."""

    hook: Callable | None = None
    state: Any = None


def timed_allreduce(state: Delegate, bucket: Any) -> Any:
    """DDP's communication hook: its built-in average of a gradient bucket over the default group, timed to its
    completion here; or, once the person registers a hook of their own, theirs (its ``dist.*`` calls are timed)."""
    if state.hook is not None:
        return state.hook(state.state, bucket)
    group = sys.modules["torch.distributed"].group.WORLD
    buffer = bucket.buffer()
    buffer.div_(group.size())
    cell = clock.begin()
    try:
        future = group.allreduce([buffer]).get_future()
    except BaseException:
        clock.end(cell)
        raise
    return future.then(functools.partial(_ended_bucket, cell))


def _ended_bucket(cell: int, future: Any) -> Any:
    clock.end(cell)
    return future.value()[0]


timed_allreduce.__annotations__ = {}  # DDP checks a hook's annotations against its own types: these are strings here


def _time_ddp(module: Any) -> None:
    """Each DistributedDataParallel made from now on: DDP's all-reduce timed from its first forward (see above).
    A hook the person registers after that (DDP takes one per model) goes to taas's, which calls it from then on."""
    ddp = module.DistributedDataParallel
    made, registered, builtin = ddp.__init__, ddp.register_comm_hook, ddp._register_builtin_comm_hook

    @functools.wraps(made)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self._taas_first_forward = self.register_forward_pre_hook(_first_forward)

    @functools.wraps(registered)
    def register_comm_hook(self: Any, state: object, hook: Callable) -> None:
        delegate = _delegate(self)
        if delegate is None:
            return registered(self, state, hook)  # taas's hook is not in (or theirs already is): DDP's own rules
        self._check_comm_hook(hook)
        delegate.hook, delegate.state = hook, state
        self._comm_hooks.append((hook, state))

    @functools.wraps(builtin)
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        self._taas_builtin_hook = comm_hook_type  # not in DDP's list of hooks: heal registers it again (rank/heal.py)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # the built-ins' Python twins

        twins = {"ALLREDUCE": default_hooks.allreduce_hook, "FP16_COMPRESS": default_hooks.fp16_compress_hook}
        delegate = _delegate(self)
        if delegate is None or getattr(comm_hook_type, "name", "") not in twins:
            return builtin(self, comm_hook_type)  # taas's hook is not in, or a built-in without a twin: DDP's own rules
        delegate.hook, delegate.state = twins[comm_hook_type.name], None

    ddp.__init__, ddp.register_comm_hook, ddp._register_builtin_comm_hook = (
        __init__, register_comm_hook, _register_builtin_comm_hook)


def _delegate(model: Any) -> Delegate | None:
    """The state of taas's hook on ``model`` while no other hook was registered after it; else None."""
    for hook, state in model._comm_hooks:
        if hook is timed_allreduce and isinstance(state, Delegate) and state.hook is None:
            return state
    return None


def _first_forward(model: Any, _inputs: Any) -> None:
    model._taas_first_forward.remove()
    del model._taas_first_forward
    if model._comm_hooks or getattr(model, "_taas_builtin_hook", None) is not None or _cuda:
        return  # the model's own hook stays (its dist.* calls are timed); CUDA: NCCL measures
    if getattr(model, "_use_python_reducer", False):
        return  # compiled autograd's reducer calls hooks per gradient, hook(state, (grad, param)): not timed
    if model.process_group is not sys.modules["torch.distributed"].group.WORLD:
        return  # a group of its own: its all-reduce is not timed (the hook holds no group, see timed_allreduce)
    model.register_comm_hook(Delegate(), timed_allreduce)


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
