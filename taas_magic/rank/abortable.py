"""Kept ranks' process group, which a failure does not end: a rank that waits in a collective for a rank whose cell
raised leaves it with an error, keeps its globals, and the next cell's collectives run on a new communicator under
the same group object (what DDP, FSDP2 and a ``DeviceMesh`` hold).

Runs in each kept rank: made by ``init_process_group`` (rank/groups.py maps gloo to :data:`BACKEND`), aborted on the
inbox's reader when the kernel says a cell failed or was interrupted (rank/betweencells.py), renewed on the main
thread before the next cell's code (:func:`renew_all`).

torch 2.13 cannot abort a gloo collective: ``ProcessGroupGloo.abort()`` is a no-op, a timeout is fixed when an op
starts, and a blocked ``wait()`` returns only when its peer's socket closes or its timeout (30 min) passes. So, as
torchft's reconfigurable process groups do, :class:`AbortableGroup` is a Python ``dist.ProcessGroup`` that forwards
each collective to its current communicator (rank/communicator.py: a ``ProcessGroupGloo`` on the rendezvous store,
a renewal's under the prefix ``taas-after-{RUN}/``) and hands the caller its own :class:`AbortableWork`.
:meth:`AbortableGroup.abort`:

- ends every unfinished work of the group at once: the rank's code (its ``wait()``, DDP's backward) goes on now;
- shuts down the communicator's own sockets, so gloo's stuck ops end on their own threads, and leaves it to the
  reaper, which destroys it once none is left (destroying one whose op is stuck would wait for it forever);
- :meth:`AbortableGroup.renew` then makes the next communicator, named by the failed run (the same on every rank);
  every rank does it before the next cell, every group in the order they were made.

A rank that died is replaced by a new process (kernel/supervision/keptcell.py): the survivors renew only their
default group, whose first communicator the new rank makes under the same prefix (:func:`join_after`), and retire
the others (``new_group``'s, a ``DeviceMesh``'s of more than one dimension): the new rank never made them, so they
say so when used, and the cell makes them again.

Every collective torch issues reaches Python first: ``dist.*`` calls the group's methods, and functional collectives
(DTensor's redistribution) call the coalesced ones, which the C++ side of a Python group forwards; those gloo has no
coalesced form of are done one tensor pair at a time (:data:`ONE_BY_ONE`). The first communicator is also the
group's registered CPU backend, for what torch asks a backend (FSDP2: whether it allocates tensors).

An abandoned op's future completes with its own tensors as they are, never with a Python exception: DDP's reducer
waits on it in C++ without the GIL, and handing it a Python error crashes the rank. :meth:`AbortableWork.wait`
raises instead, and the cell is interrupted (SIGINT) before the abort, so a DDP backward ends into a
``KeyboardInterrupt`` before the optimizer's step.
"""

from __future__ import annotations

import datetime
import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from taas_magic.rank.communicator import Communicator, reaper

BACKEND = "taas_gloo"
# an op a peer's socket ended (it died) waits this long for this rank's own abort: in kept ranks the kernel's Abandon
# follows every failure within about a second, and its SIGINT comes first, so DDP's backward ends into a
# KeyboardInterrupt instead of going on to the optimizer's step with this rank's own gradients (replicas that differ)
PEER_ABORT_SECONDS = 10.0

# every collective of a ProcessGroup that Python code calls (distributed_c10d.py calls them on the group object), and
# its name on the communicator (a Backend, where some keep their older names)
FORWARDED = {
    "allreduce": "allreduce", "allreduce_coalesced": "allreduce_coalesced", "allgather": "allgather",
    "allgather_coalesced": "allgather_coalesced", "all_gather_single": "_allgather_base",
    "_allgather_base": "_allgather_base", "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "allgather_into_tensor_coalesced": "allgather_into_tensor_coalesced", "broadcast": "broadcast",
    "barrier": "barrier", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "_reduce_scatter_base",
    "_reduce_scatter_base": "_reduce_scatter_base", "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced", "alltoall": "alltoall",
    "all_to_all_single": "alltoall_base", "alltoall_base": "alltoall_base", "send": "send", "recv": "recv",
    "recv_anysource": "recv_anysource", "monitored_barrier": "monitored_barrier",
}

# coalesced collectives gloo lacks, done one tensor pair at a time
ONE_BY_ONE = {"allgather_into_tensor_coalesced": "_allgather_base",
              "reduce_scatter_tensor_coalesced": "_reduce_scatter_base"}

# every group made here (default and subgroups), in the order they were made: the same on every rank, so they
# are renewed in the same order everywhere (each renewal is a rendezvous)
_groups: "list[weakref.ReferenceType[AbortableGroup]]" = []
_joining = ""  # a new rank in a dead one's place: the run its first group's first communicator is made after


class Aborted(RuntimeError):
    """A collective that another rank's failure ended."""


class AbortableWork(dist.Work):
    """The caller's handle of one forwarded collective: done when the communicator's ops are (one, or one per tensor
    of a coalesced call the communicator has no coalesced form of), or ended by an abort.

    An op that failed, or was abandoned, raises in :meth:`wait` (the cell's ``dist.*`` calls); its future completes
    with the op's own tensors as they are instead of an error: C++ that waits on it (DDP's reducer) must not be
    handed a Python exception without the GIL (that crashes the rank), and the cell is interrupted meanwhile anyway
    (rank/betweencells.py), so DDP's backward ends and the ``KeyboardInterrupt`` comes before the optimizer's step.
    """

    def __init__(self, inner: list[dist.Work], value: Any, op_over: Callable[[], None]):
        super().__init__()
        self._value, self._op_over = value, op_over
        self.error: BaseException | None = None
        self._left = len(inner)
        self._settling = threading.Lock()
        self._future: torch.futures.Future = torch.futures.Future()
        for work in inner:
            try:
                work.get_future().add_done_callback(self._settle)
            except RuntimeError:  # a work without a future (gloo's send and recv): waited for on a thread of its own
                threading.Thread(target=self._wait_inner, args=(work,), name="taas-work", daemon=True).start()

    def _settle(self, done: torch.futures.Future) -> None:
        self._op_over()
        try:
            done.value()
        except Exception as error:  # noqa: BLE001 - the op's own failure becomes the caller's
            self._failed(error)
            return
        self._one_done()

    def _failed(self, error: BaseException) -> None:
        """The op failed (a peer's socket closed: it died, or its own abort shut it): said after
        :data:`PEER_ABORT_SECONDS`, unless this rank's abort came meanwhile and said why (gloo's own words blame
        "a remote worker crashing"), its interrupt first."""
        if not self._future.done():  # (ended by this rank's abort already: nothing to say)
            threading.Timer(PEER_ABORT_SECONDS, self.end, args=(error,)).start()

    def _wait_inner(self, work: dist.Work) -> None:
        try:
            work.wait()
        except Exception as error:  # noqa: BLE001 - the op's own failure becomes the caller's
            self._op_over()
            self._failed(error)
            return
        self._op_over()
        self._one_done()

    def _one_done(self) -> None:
        with self._settling:
            self._left -= 1
            if self._left or self._future.done():
                return
            self._future.set_result(self._value)
            self._value = None  # the future holds it; nothing else may keep the tensors alive

    def end(self, error: BaseException) -> None:
        """Over with ``error`` (an abort, or the op's own failure): :meth:`wait` raises it."""
        with self._settling:
            if self._future.done():
                return
            self.error = error
            self._future.set_result(self._value)
            self._value = None

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._future.wait()
        if self.error is not None:
            raise self.error
        return True

    def forgive(self) -> None:
        """Its group was renewed: waiting on it no longer raises (what still holds it, such as FSDP2's all-gather
        state, is reset before the next cell: rank/recovery.py), its tensors as the abort left them."""
        self.error = None

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self.error is None

    def exception(self) -> BaseException | None:
        return self.error

    def result(self) -> Any:
        self.wait()
        return self._future.value()

    def get_future(self) -> torch.futures.Future:
        return self._future


class AbortableGroup(dist.ProcessGroup):
    """A process group whose communicator can be abandoned and renewed (see the module docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stubs know only (store, rank, size)
        global _joining
        self._store, self._timeout = store, timeout
        self._lock = threading.Lock()
        joining, _joining = _joining, ""
        self._current: Communicator | None = Communicator(store, rank, size, timeout, joining)
        self.retired = False  # a rank it spanned was replaced: it is never renewed
        self.renewals = 0
        self.aborted_why: str | None = None
        self._abandoned: list[AbortableWork] = []  # the works the last abort ended, until the group is renewed
        # the group's registered CPU backend (what torch's C++ asks a group's backend): its first communicator
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self._current.gloo)
        _groups.append(weakref.ref(self))

    def getBackendName(self) -> str:
        return BACKEND

    def _get_backend(self, device: Any) -> Any:
        """The current communicator, for what Python asks a group's backend (its options and timeout: a pdb hold
        raises it, rank/cellpdb.py; whether it allocates tensors); the first while none is current."""
        current = self._current
        return current.gloo if current is not None else super()._get_backend(device)

    def _forward(self, name: str, *args: Any) -> AbortableWork:
        with self._lock:
            current = self._current
            if current is None:
                raise Aborted(f"taas: this group's collectives were abandoned ({self.aborted_why}); " + (
                    "make it again: the rank that replaced a dead one never made it" if self.retired
                    else "they run again in the next cell"))
            operation = getattr(current.gloo, name, None)
            if operation is not None:
                ops, value = [operation(*args)], _outputs(args)
            elif name in ONE_BY_ONE:  # gloo has no coalesced form: one op per tensor pair, one work for them all
                outputs, inputs, options = args
                single = getattr(current.gloo, ONE_BY_ONE[name])
                ops, value = [single(out, into, options) for out, into in zip(outputs, inputs)], outputs
            else:
                raise RuntimeError(f"taas: the gloo backend has no {name}")
            current.started(work := AbortableWork(ops, value, current.op_over), len(ops))
        return work

    def abort(self, why: str = "a rank failed") -> None:
        """Every unfinished collective fails now; the communicator is shut down and reaped (module docstring)."""
        with self._lock:
            dead, self._current = self._current, None
            if dead is None:
                return
            self.aborted_why = why
            pending = list(dead.unfinished())
            self._abandoned = pending
        error = Aborted(f"taas: {why}: this collective was abandoned; the ranks keep their state")
        for work in pending:
            work.end(error)
        dead.shut_down()
        reaper.take(dead)

    def rehome(self, store: dist.Store) -> None:
        """Its next communicators are made on ``store`` (rank 0 was replaced: its new process hosts the store)."""
        self._store = store

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    def retire(self, why: str) -> None:
        """Never renewed: a rank it spans was replaced by a process that never made it."""
        self.abort(why)
        self.aborted_why, self.retired = why, True

    def renew(self, after: str) -> None:
        """A new communicator, if this one was aborted, named by the failed run ``after`` (the same on every rank):
        every rank calls it (its rendezvous waits for them all)."""
        if self._current is not None:
            return
        made = Communicator(self._store, self.rank(), self.size(), self._timeout, after)
        with self._lock:
            self._current, self.aborted_why = made, None
            self.renewals += 1
            abandoned, self._abandoned = self._abandoned, []
        for work in abandoned:
            work.forgive()


def _forwarder(name: str, inner: str) -> Callable[..., AbortableWork]:
    def forwarded(self: AbortableGroup, *args: Any, **kwargs: Any) -> AbortableWork:
        return self._forward(inner, *args, *kwargs.values())  # keywords are the trailing options (``opts=``)

    forwarded.__name__ = name
    return forwarded


for _name, _inner in FORWARDED.items():
    setattr(AbortableGroup, _name, _forwarder(_name, _inner))


def _live_groups() -> list[AbortableGroup]:
    _groups[:] = [reference for reference in _groups if reference() is not None]
    return [group for reference in _groups if (group := reference()) is not None]


def abort_all(why: str) -> None:
    """Every group of this rank aborted (the kernel's word that the cell failed or was interrupted)."""
    for group in _live_groups():
        group.abort(why)


def renew_all(after: str, replaced: tuple[int, ...] = ()) -> int:
    """Every aborted group renewed after the failed run ``after``, in the order they were made, before the next
    cell's code; how many were. ``replaced``: ranks whose new processes join the default group (the first made)
    only: every other group is retired."""
    live = _live_groups()
    if replaced:
        ranks = ", ".join(map(str, replaced))
        for group in live[1:]:
            group.retire(f"rank {ranks} died and was replaced after this group was made")
    aborted = [group for group in live if group.aborted_why is not None and not group.retired]
    for group in aborted:
        group.renew(after)
    return len(aborted)


def default_group() -> AbortableGroup | None:
    """This rank's default group, if it is one of these (the first made)."""
    live = _live_groups()
    return live[0] if live and dist.is_initialized() else None


def has_default_group() -> bool:
    """Whether this rank's default process group is one of these (and not retired)."""
    group = default_group()
    return group is not None and not group.retired


def join_after(after: str) -> None:
    """This rank replaces a dead one: the next group made (the default group) joins the survivors' renewal of
    theirs after ``after``."""
    global _joining
    _joining = after


def create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> AbortableGroup:
    """The backend's creator (``dist.Backend.register_backend``)."""
    return AbortableGroup(store, rank, size, timeout)


def register() -> None:
    """:data:`BACKEND` known to ``init_process_group`` (once)."""
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, create, devices=["cpu"])


def _outputs(args: tuple) -> Any:
    """What a collective's future holds when it is done: its first argument, the output (or in-place) tensors, as a
    list (gloo's futures hold a list); None for a barrier's options."""
    first = args[0] if args else None
    if isinstance(first, torch.Tensor):
        return [first]
    return first if isinstance(first, list) else None
