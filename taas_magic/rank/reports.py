"""The rank's half of ``taas.report`` and of the health line: cheap to call, sent in batches.

``taas.report(step, loss=...)`` is :func:`report` in a rank: it only appends a tuple to a
list (a few hundred nanoseconds), so a training loop that reports every step is not slowed;
a daemon thread sends what piled up every quarter of a second as one ``report`` frame (plain
numbers as they are; a tensor's ``.item()`` is taken there, off the training thread), with the rank's health (resident memory,
CPU time, and on CUDA the memory allocated and the GPU's utilisation) every two seconds
even when nothing was reported. What is still pending when the cell ends is sent before the
rank's results (:func:`flush`), so the kernel's record of the run is whole.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from taas_magic import wire

SEND_SECONDS = 0.25
HEALTH_SECONDS = 2.0

_pending: list[tuple[Any, dict]] = []
_keep = _pending.append
_sent = 0  # reports sent so far: a report without a step is numbered by its place
_lock = threading.Lock()  # one sender at a time: the thread, or flush at the end
_channel: wire.BlockingChannel | None = None


def report(step: Any = None, **metrics: Any) -> None:
    """``taas.report`` inside a rank (the bootstrap puts it there): keep it for the next batch."""
    _keep((step, metrics))


def start(channel: wire.BlockingChannel) -> None:
    """Send batches and health from a daemon thread, for the rest of the rank's life."""
    global _channel
    _channel = channel
    threading.Thread(target=_send_forever, name="taas-reports", daemon=True).start()


def _send_forever() -> None:
    last_health = 0.0
    while True:
        time.sleep(SEND_SECONDS)
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
    """Send what is pending now (the cell ended)."""
    try:
        _send(health=True)
    except OSError:
        pass


def _send(health: bool) -> None:
    global _sent
    with _lock:
        if _channel is None or not (_pending or health):
            return
        batch = _pending[:]
        del _pending[: len(batch)]
        reports = [(_sent + i if step is None else step if type(step) is int else _number(step), _plain(metrics))
                   for i, (step, metrics) in enumerate(batch)]
        _sent += len(batch)
        message = {"at": time.monotonic(), "reports": reports, "health": _health() if health else None}
        _channel.send("report", wire.dumps(message))


def _number(value: Any) -> float | int:
    number = _float(value)
    return int(number) if number is not None and number.is_integer() else (number if number is not None else 0)


def _float(value: Any) -> float | None:
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, RuntimeError):
        return None  # not a number (a string, a tensor of many values): not drawn


def _plain(metrics: dict) -> dict[str, float]:
    """Numbers as they are (the common case, checked cheaply); others converted, or left out."""
    for value in metrics.values():
        if type(value) is not float and type(value) is not int:
            return {name: number for name, value in metrics.items() if (number := _float(value)) is not None}
    return metrics


def _health() -> dict:
    """What the health line shows for this rank, measured here (the kernel may be another host)."""
    times = os.times()
    figures: dict[str, Any] = {"at": time.monotonic(), "cpu": times.user + times.system}
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
            figures["gpu_use"] = cuda.utilization()
    except Exception:  # noqa: BLE001 - no NVML (utilisation), a CUDA error: what was measured is still worth showing
        pass
    return figures
