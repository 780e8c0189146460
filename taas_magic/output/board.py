"""What the cell shows of a run while it trains: a live chart and a per-rank health line.

Every rank sends what ``taas.report`` collected in batches (output/reports.py). Here, in the
kernel, the :class:`Board` keeps every rank's reports and publishes two displays, each
updated in place (``update_display_data``):

- the chart: one panel per metric rank 0 reports, against its ``step`` (or the report's
  number), rank 0's line drawn over the band between the lowest and the highest rank where
  every rank reports that metric (the ranks' reports are aligned by their order). It is an
  SVG image drawn here without any plotting library, so it costs the kernel a few
  milliseconds, needs nothing installed, stays in the saved notebook and renders in any front
  end. At most twice a second, and only when something new arrived; once more at the end.
- the health line, about every 2 s: for each rank its reports per second, resident memory,
  CPU use, and on CUDA the GPU memory allocated and utilisation; a rank whose time between
  reports is more than 1.5x the ranks' median (the lower median: with two ranks, the faster
  one's) is marked as the straggler.

Both displays are published before any rank starts (:meth:`Board.start`), so they sit above
rank 0's text: a display arriving in the middle of a ``\r`` progress line would cut it in
two in the front end (the text after the display cannot redraw the line before it). A cell
that never reports keeps an empty chart output.

``taas.metrics()`` in the notebook returns the last run's rank-0 reports (:meth:`Board.metrics`).
"""

from __future__ import annotations

import secrets
import statistics
import time
from dataclasses import dataclass, field
from html import escape
from typing import Callable

from taas_magic.output.relay import Publish
from taas_magic.protocol import Display, Report

CHART_SECONDS = 0.5
HEALTH_SECONDS = 2.0
STRAGGLER_RATIO = 1.5
MAX_POINTS = 1000  # per line drawn: a longer series is thinned evenly
PANEL_WIDTH, PANEL_HEIGHT, MARGIN = 560, 150, 46
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf")


@dataclass
class _Rank:
    steps: dict[str, list[float]] = field(default_factory=dict)  # metric -> steps, in report order
    values: dict[str, list[float]] = field(default_factory=dict)  # metric -> values
    reports: list[dict] = field(default_factory=list)  # rank 0's, for taas.metrics()
    batches: list[tuple[float, int]] = field(default_factory=list)  # (when sent, by the rank's clock; reports)
    health: tuple[dict, dict] | None = None  # the last two health figures


class Board:
    def __init__(self, ranks: int, publish: Publish, points: Callable[[list], None] | None = None):
        self.ranks = [_Rank() for _ in range(ranks)]
        self.publish = publish
        self.points = points  # rank 0's reports as they arrive, for the run log's record
        token = secrets.token_hex(4)
        self.chart_id, self.health_id = f"taas-chart-{token}", f"taas-health-{token}"
        self.shown: set[str] = set()
        self.dirty = False
        self.last_chart = self.last_health = 0.0

    def add(self, rank: int, batch: Report) -> None:
        """A rank's batch: its reports (and perhaps its health)."""
        record = self.ranks[rank]
        if batch.reports:
            record.batches.append((batch.at, len(batch.reports)))
            if rank == 0 and self.points is not None:
                self.points(batch.reports)
        for step, metrics in batch.reports:
            if rank == 0:
                record.reports.append({"step": step, **metrics})
            for name, value in metrics.items():
                record.steps.setdefault(name, []).append(step)
                record.values.setdefault(name, []).append(value)
            self.dirty = True
        if batch.health is not None:
            previous = record.health[1] if record.health is not None else batch.health
            record.health = (previous, batch.health)

    def start(self) -> None:
        """The two displays, in their places above the ranks' output, before any rank runs."""
        self._publish(self.health_id, {"text/plain": f"taas health · starting {len(self.ranks)} rank(s)"})
        self._publish(self.chart_id, {"text/plain": ""})

    def metrics(self) -> list[dict]:
        return list(self.ranks[0].reports)

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.dirty and (force or now - self.last_chart >= CHART_SECONDS):
            self.dirty, self.last_chart = False, now
            svg = self.chart()
            if svg is not None:
                self._publish(self.chart_id, {"image/svg+xml": svg, "text/plain": self._chart_text()})
        if any(record.health for record in self.ranks) and (force or now - self.last_health >= HEALTH_SECONDS):
            self.last_health = now
            self._publish(self.health_id, {"text/plain": self.health_line()})

    def _publish(self, display_id: str, data: dict) -> None:
        self.publish(Display(data, {}, {"display_id": display_id}, display_id in self.shown))
        self.shown.add(display_id)

    def _chart_text(self) -> str:
        last = self.ranks[0].reports[-1] if self.ranks[0].reports else {}
        return "taas chart · " + ", ".join(f"{name} {value:.4g}" for name, value in last.items())

    # -- the chart ---------------------------------------------------------------------------
    def chart(self) -> str | None:
        names = list(self.ranks[0].values)
        if not names:
            return None
        panels = [self._panel(name, index) for index, name in enumerate(names)]
        height = PANEL_HEIGHT * len(panels)
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{PANEL_WIDTH}" height="{height}" '
                f'viewBox="0 0 {PANEL_WIDTH} {height}" font-family="sans-serif" font-size="11">'
                '<rect width="100%" height="100%" fill="white"/>' + "".join(panels) + "</svg>")

    def _panel(self, name: str, index: int) -> str:
        steps, values = self.ranks[0].steps[name], self.ranks[0].values[name]
        band = self._band(name)  # (index, lowest, highest), thinned
        lows = [low for _, low, _ in band] if band else values
        highs = [high for _, _, high in band] if band else values
        low, high = min(min(lows), min(values)), max(max(highs), max(values))
        if high == low:
            low, high = low - 0.5, high + 0.5
        first, last = steps[0], steps[-1] if steps[-1] != steps[0] else steps[0] + 1
        top = index * PANEL_HEIGHT
        left, right, upper, lower = MARGIN, PANEL_WIDTH - 10, top + 18, top + PANEL_HEIGHT - 22

        def x(step: float) -> float:
            return left + (step - first) / (last - first) * (right - left)

        def y(value: float) -> float:
            return lower - (value - low) / (high - low) * (lower - upper)

        parts = [f'<text x="{left}" y="{top + 13}" font-weight="bold">{escape(name)}</text>',
                 f'<text x="{right}" y="{top + 13}" text-anchor="end">rank 0: {values[-1]:.4g}'
                 + (" (band: every rank's min-max)" if band else "") + "</text>",
                 f'<rect x="{left}" y="{upper}" width="{right - left}" height="{lower - upper}" fill="none" stroke="#ccc"/>']
        for value in (low, (low + high) / 2, high):
            parts.append(f'<text x="{left - 4}" y="{y(value) + 4:.1f}" text-anchor="end">{value:.3g}</text>')
        for step in (first, last):
            parts.append(f'<text x="{x(step):.1f}" y="{lower + 14}" text-anchor="middle">{step:g}</text>')
        colour = COLOURS[index % len(COLOURS)]
        if band:
            upper_edge = " ".join(f"{x(steps[i]):.1f},{y(high):.1f}" for i, _, high in band)
            lower_edge = " ".join(f"{x(steps[i]):.1f},{y(low):.1f}" for i, low, _ in reversed(band))
            parts.append(f'<polygon points="{upper_edge} {lower_edge}" fill="{colour}" fill-opacity="0.2" stroke="none"/>')
        line = " ".join(f"{x(steps[i]):.1f},{y(values[i]):.1f}" for i in _thin(range(len(values))))
        parts.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        return "".join(parts)

    def _band(self, name: str) -> list[tuple[int, float, float]]:
        """(report index, lowest, highest) over the ranks where every rank reports ``name``, at
        the points drawn only (a run of 100,000 reports costs a thousand, not 100,000, each time)."""
        if len(self.ranks) < 2 or not all(name in record.values for record in self.ranks):
            return []
        series = [record.values[name] for record in self.ranks]
        length = min(len(values) for values in series)
        return [(i, min(values[i] for values in series), max(values[i] for values in series))
                for i in _thin(range(length))]

    # -- the health line -----------------------------------------------------------------------
    def health_line(self) -> str:
        intervals = {rank: _interval(record.batches) for rank, record in enumerate(self.ranks)}
        known = [value for value in intervals.values() if value is not None]
        median = statistics.median_low(known) if len(known) > 1 else None  # low: with 2 ranks, the faster one's
        parts = []
        for rank, record in enumerate(self.ranks):
            words = [f"rank {rank}:"]
            interval = intervals[rank]
            if interval is not None:
                words.append(f"{1 / interval:,.0f} reports/s" if interval > 0 else "reports")
            if record.health is not None:
                before, now = record.health
                if "rss" in now:
                    words.append(_size(now["rss"]))
                seconds = now["at"] - before["at"]
                if seconds > 0:
                    words.append(f"CPU {100 * (now['cpu'] - before['cpu']) / seconds:.0f}%")
                if "gpu_memory" in now:
                    words.append(f"GPU {_size(now['gpu_memory'])}")
                if "gpu_use" in now:
                    words.append(f"{now['gpu_use']}% busy")
            if median and interval is not None and interval > STRAGGLER_RATIO * median:
                words.append("← straggler")
            parts.append(" ".join(words))
        return "taas health · " + " | ".join(parts)


def _size(count: int) -> str:
    return f"{count / 2**30:.2f} GB" if count >= 2**30 else f"{count / 2**20:.0f} MB"


def _interval(batches: list[tuple[float, int]], window: int = 8) -> float | None:
    """A rank's mean time between reports over its last batches (about 2 s); None before two batches."""
    recent = batches[-window:]
    count = sum(reports for _, reports in recent[1:])
    if len(recent) < 2 or not count:
        return None
    return (recent[-1][0] - recent[0][0]) / count


def _thin(indices: range) -> list[int]:
    """At most MAX_POINTS indices, evenly spread, the last always kept."""
    if len(indices) <= MAX_POINTS:
        return list(indices)
    stride = len(indices) / MAX_POINTS
    kept = [indices[int(i * stride)] for i in range(MAX_POINTS)]
    return kept + [indices[-1]] if kept[-1] != indices[-1] else kept
