"""The rank's half of ``taas.report`` and of the health line: cheap to call, sent in batches.

Runs in each rank: :func:`report` on the cell's thread, the sending on a daemon thread of its own
(``taas-reports``).

``taas.report(step, loss=...)`` is :func:`report` in a rank: for plain numbers it only
appends a tuple to a list (a few hundred nanoseconds), so a training loop that reports every
step is not slowed; a daemon thread sends what piled up every quarter of a second as one
``report`` frame, with the rank's health (resident memory, CPU time, and on CUDA the memory
allocated and the GPU's utilisation) every two seconds even when nothing was reported. What
is still pending when the cell ends is sent before the rank's results (:func:`flush`), so
the kernel's record of the run is whole.

Tensors never make the rank wait for its GPU:

- a one-element CUDA tensor is not read where it is reported: :func:`report` starts an
  asynchronous copy of it into a slot of pinned host memory on the current stream and
  records a CUDA event after the copy (:class:`Staged`; slots and events come from a pool,
  so reporting every step allocates no pinned memory after the first few). The sender sends
  reports in order up to the first one whose copy has not completed (``event.query()``), and
  leaves it and the ones after it for the next batch: the values are drawn a batch late,
  never out of order, and the step numbering is as if they had been sent at once;
- any other tensor (CPU, or a device with no events) is read with ``.item()`` by the sender
  thread, off the training thread, as before; a tensor of more than one element is left out;
- a CUDA tensor reported while the current stream captures a CUDA graph is left out (it holds
  no value yet, and reading it would break the capture); one whose copy cannot be started
  (no pinned memory to be had) is read by the sender with ``.item()``, as any other tensor.

:func:`flush` waits for the copies still in flight (``event.synchronize()``) before the last
batch. When it is called while an exception is being handled (the rank reports its error
next), it waits at most ``ERROR_WAIT_SECONDS``: a stream that never finishes (a collective
whose peer died) must not keep the error from the kernel; the values not copied by then are
left out. A copy that failed (a CUDA error) leaves its value out; it never ends the reports.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from taas_magic.protocol import PeerChannel, ToKernel


# -- this feature's frames (protocol.py frames them, and lists every frame) --------------------
@dataclass(frozen=True)
class Report(ToKernel, kind="report"):
    """A batch of a rank's taas.report calls (output/reports.py)."""

    at: float  # the rank's monotonic clock when sent
    reports: list[tuple[float | int, dict[str, float]]]  # (step, metrics), in order
    health: dict | None  # the rank's figures (cpu, rss, gpu), about every 2 s


SEND_SECONDS = 0.25
HEALTH_SECONDS = 2.0
ERROR_WAIT_SECONDS = 1.0  # how long flush waits for copies in flight on the error path
SLAB = 128  # pinned slots allocated at once (one cudaHostAlloc) when the pool runs dry

_pending: list[tuple[Any, dict]] = []
_keep = _pending.append
_sent = 0  # reports sent so far: a report without a step is numbered by its place
_lock = threading.Lock()  # one sender at a time: the thread, or flush at the end
_channel: PeerChannel | None = None
_more: Callable[[float], dict] | None = None  # more of the rank's figures, measured with its health (the hang line's)


def _nothing() -> None:
    pass


after_report: Callable[[], None] = _nothing  # then, on the reporting thread (DDP's timing: output/ddptiming.py)


def report(step: Any = None, **metrics: Any) -> None:
    """``taas.report`` inside a rank (the bootstrap puts it there): keep it for the next batch."""
    for value in metrics.values():
        if type(value) is not float and type(value) is not int:
            metrics = {name: kept for name, value in metrics.items() if (kept := _stage(value)) is not None}
            break
    if type(step) is not int and step is not None:
        step = _stage(step)
    _keep((step, metrics))
    after_report()


class Staged:
    """A reported value on its way to host memory: ``buffer`` (a pinned host tensor) holds it
    once ``event`` (anything with ``query()`` and ``synchronize()``, a ``torch.cuda.Event``
    here) has completed. :meth:`item` reads it once and gives its slot back to ``pool``."""

    __slots__ = ("buffer", "event", "pool", "key", "failed")

    def __init__(self, buffer: Any, event: Any, pool: SlotPool | None = None, key: tuple = ()):
        self.buffer, self.event, self.pool, self.key, self.failed = buffer, event, pool, key, False

    def ready(self) -> bool:
        """The copy completed (or failed: then :meth:`item` raises and the value is left out)."""
        try:
            return self.failed or bool(self.event.query())
        except Exception:  # noqa: BLE001 - a CUDA error: the value is lost, the reports go on
            self.failed = True
            return True

    def wait(self, deadline: float | None) -> None:
        """Until the copy completed or failed; with a deadline, past it the value is given up."""
        try:
            if deadline is None:
                self.event.synchronize()
                return
            while not self.event.query():
                if time.monotonic() >= deadline:
                    self.failed = True  # still in flight: its slot is never given back, never reused
                    return
                time.sleep(0.001)
        except Exception:  # noqa: BLE001 - a CUDA error: the value is lost, the reports go on
            self.failed = True

    def item(self) -> Any:
        """The value, read once (the sender's ``_float`` reads it as it reads a tensor)."""
        if self.failed:
            raise RuntimeError("the value's copy to the host did not complete")
        value = self.buffer.item()  # pinned host memory the copy has filled: no device sync
        if self.pool is not None:
            self.pool.give_back(self)
        return value


class SlotPool:
    """Pinned one-element host buffers, each with its CUDA event, by (device, dtype): taken by
    :func:`report` on the training thread, given back by the sender once read. It grows by
    ``SLAB`` slots (one pinned allocation) when it runs dry, and never shrinks: it holds as
    many slots as were ever in flight at once (about one batch of reports)."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[tuple[Any, Any]]] = {}
        self._grow = threading.Lock()

    def stage(self, torch: Any, tensor: Any) -> Staged:
        """Start copying the one-element CUDA ``tensor`` to the host, after the work queued so
        far on the current stream (the stream that computed it, in a plain training loop)."""
        key = (tensor.device, tensor.dtype)
        try:
            buffer, event = self._free[key].pop()  # list.pop is atomic: the sender may be appending
        except (KeyError, IndexError):
            buffer, event = self._more(torch, key)
        buffer.copy_(tensor.detach().reshape(()), non_blocking=True)
        event.record(torch.cuda.current_stream(tensor.device))
        return Staged(buffer, event, self, key)

    def _more(self, torch: Any, key: tuple) -> tuple[Any, Any]:
        with self._grow:
            slab = torch.empty(SLAB, dtype=key[1], pin_memory=True)
            slots = [(slab[index], torch.cuda.Event()) for index in range(SLAB)]
            self._free.setdefault(key, []).extend(slots[1:])
        return slots[0]

    def give_back(self, staged: Staged) -> None:
        self._free[staged.key].append((staged.buffer, staged.event))


_pool = SlotPool()


def _stage(value: Any) -> Any:
    """What :func:`report` keeps for a value that is not a plain number: a one-element CUDA
    tensor becomes a :class:`Staged` copy; None (left out) while its stream captures a graph;
    anything else as it is, for the sender to convert."""
    torch: Any = sys.modules.get("torch")
    tensor = getattr(torch, "Tensor", None)  # None: no torch here, or one still being imported
    if tensor is None or not isinstance(value, tensor) or not value.is_cuda or value.numel() != 1:
        return value
    if torch.cuda.is_current_stream_capturing():
        return None
    try:
        return _pool.stage(torch, value)
    except Exception:  # noqa: BLE001 - no pinned memory, a CUDA error: read it as before (.item() in the sender)
        return value  # a report never raises into the training loop for our sake


def start(channel: PeerChannel, more: Callable[[float], dict] | None = None) -> None:
    """Send batches and health from a daemon thread, for the rest of the rank's life; ``more(now)``: figures sent
    with the health besides its own (the hang line's: autopsy/waiting.py)."""
    global _channel, _more
    _channel, _more = channel, more
    threading.Thread(target=_send_forever, name="taas-reports", daemon=True).start()


_paused = threading.Event()  # a kept rank between cells (rank/betweencells.py): nothing is sent


def pause() -> None:
    """A kept rank between its cells: no batches and no health until :func:`resume` (nobody reads them)."""
    _paused.set()


def resume() -> None:
    _paused.clear()


def _send_forever() -> None:
    last_health = 0.0
    while True:
        time.sleep(SEND_SECONDS)
        if _paused.is_set():
            continue
        now = time.monotonic()
        health = now - last_health >= HEALTH_SECONDS
        if health:
            last_health = now
        try:
            _send(health)
        except OSError:
            return  # the kernel stopped listening: the rank is being stopped
        except Exception:  # noqa: BLE001 - a report that cannot be sent must not end the reports after it
            continue


def flush() -> None:
    """Send what is pending now (the cell ended, or the rank reports its error next): copies in
    flight are waited for first, on the error path at most ``ERROR_WAIT_SECONDS``."""
    failing = sys.exc_info()[0] is not None  # called from an except block: the error report follows
    deadline = time.monotonic() + ERROR_WAIT_SECONDS if failing else None
    for step, metrics in _pending[:]:
        for value in (step, *metrics.values()):
            if type(value) is Staged:
                value.wait(deadline)
    try:
        _send(health=True)
    except OSError:
        pass


def _send(health: bool) -> None:
    global _sent
    with _lock:
        if _channel is None or not (_pending or health):
            return
        reports = _convert(_pending[:])
        if not (reports or health):
            return  # the oldest report's copy is still in flight: it leads the next batch
        del _pending[: len(reports)]
        reports = [(_sent + i if step is None else step if type(step) is int else _number(step), metrics)
                   for i, (step, metrics) in enumerate(reports)]
        _sent += len(reports)
        _channel.send(Report(time.monotonic(), reports, _health() if health else None))


def _convert(batch: list[tuple[Any, dict]]) -> list[tuple[Any, dict]]:
    """The reports of ``batch`` up to the first one with a copy still in flight, their metrics
    plain numbers (the step is converted by the caller, which numbers them)."""
    converted: list[tuple[Any, dict]] = []
    for step, metrics in batch:
        for value in metrics.values():
            if type(value) is not float and type(value) is not int:
                if not all(each.ready() for each in (step, *metrics.values()) if type(each) is Staged):
                    return converted
                metrics = {name: number for name, value in metrics.items() if (number := _float(value)) is not None}
                break
        else:
            if type(step) is Staged and not step.ready():
                return converted
        converted.append((step, metrics))
    return converted


def _number(value: Any) -> float | int:
    number = _float(value)
    return int(number) if number is not None and number.is_integer() else (number if number is not None else 0)


def _float(value: Any) -> float | None:
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None  # not a number (a string, a tensor of many values, a lost copy): not drawn


def _health() -> dict:
    """What the health line shows for this rank, measured here (the kernel may be another host)."""
    times = os.times()
    now = time.monotonic()
    figures: dict[str, Any] = {"at": now, "cpu": times.user + times.system, "pid": os.getpid(),
                               "reports": _sent + len(_pending)}
    if _more is not None:  # how long the cell has waited in one collective (the hang line: autopsy/hangline.py)
        figures.update(_more(now))
    try:
        with open("/proc/self/statm") as statm:
            figures["rss"] = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    # torch as the cell has it: perhaps half imported (the cell's main thread is importing it now)
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        if cuda is not None and cuda.is_available() and cuda.is_initialized():
            figures["gpu_memory"] = cuda.memory_allocated()
            figures["gpu"] = cuda.current_device()
            figures["gpu_use"] = cuda.utilization()
    except Exception:  # noqa: BLE001 - no NVML (utilisation), a CUDA error: what was measured is still worth showing
        pass
    return figures
