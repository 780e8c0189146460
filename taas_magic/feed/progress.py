"""The extraction's progress line: one display in the cell, updated in place.

Runs in the kernel, on a run's own thread: the data plane updates it, and its display goes into the
run's log (output/relay.py's ``Publish``).

It is published before the ranks print anything, so it sits above rank 0's stream,
and is updated (``update_display_data``) at most twice a second, plus once at the end
with the cache's real footprint (bytes in RAM and on disk, measured on the files).
"""

from __future__ import annotations

import secrets
import time

from taas_magic.feed.coordinator import FeedCoordinator
from taas_magic.output.relay import Display, Publish

INTERVAL = 0.5



def _rate(count: int, seconds: float) -> str:
    return f"{count / seconds:,.0f}/s" if seconds > 0 else "-"


def _bytes(count: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"


class ProgressLine:
    def __init__(self, coordinator: FeedCoordinator, publish: Publish, workers: int):
        self.coordinator = coordinator
        self.publish = publish
        self.workers = workers
        self.display_id = "taas-data-" + secrets.token_hex(4)
        self.started = time.monotonic()
        self.last = 0.0
        self.finished_at: dict[str, float] = {}
        self.shown = False

    def text(self, usage: tuple[int, int] | None = None) -> str:
        now = time.monotonic()
        parts = []
        for figures in self.coordinator.figures():
            name = figures["name"]
            if figures["finished"]:
                self.finished_at.setdefault(name, now)
            elapsed = self.finished_at.get(name, now) - self.started
            line = f"{name}: {figures['extracted']:,}/{figures['target']:,} extracted"
            line += f" in {elapsed:.1f} s ({_rate(figures['extracted'], elapsed)})"
            if figures["finished"]:
                line += " · extraction done"
            else:
                line += f" · {figures['waiting']:,} waiting"
            if figures["replayed"]:
                line += f" · {figures['replayed']:,} replayed from cache"
            parts.append(line)
        text = f"taas data ({self.workers} worker{'s' if self.workers != 1 else ''}) · " + " | ".join(parts)
        if usage is not None:
            text += f" · cache {_bytes(usage[0])} in RAM, {_bytes(usage[1])} on disk"
        return text

    def show(self, force: bool = False, usage: tuple[int, int] | None = None) -> None:
        now = time.monotonic()
        if not force and now - self.last < INTERVAL:
            return
        self.last = now
        self.publish(Display({"text/plain": self.text(usage)}, {}, {"display_id": self.display_id}, self.shown))
        self.shown = True

    def seconds_until_due(self, now: float) -> float:
        return max(0.0, self.last + INTERVAL - now)
