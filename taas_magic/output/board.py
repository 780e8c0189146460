"""What the cell shows of a run while it trains: a live chart and a per-rank health line.

Runs in the kernel, on the run's own thread, where the supervisor hands it the ranks' reports.

Every rank sends what ``taas.report`` collected in batches (output/reports.py). Here, in the
kernel, the :class:`Board` keeps the ranks' reports in bounded memory (below) and publishes
two displays, each updated in place (``update_display_data``):

- the chart: one panel per metric rank 0 reports, against its ``step`` (or the report's
  number), rank 0's line drawn over the band between the lowest and the highest rank where
  every rank reports that metric (the ranks' reports are aligned by their order: the n-th
  value of the metric on each rank, at the n-th of rank 0's steps). It is an
  SVG image drawn here without any plotting library, so it costs the kernel a few
  milliseconds, needs nothing installed, stays in the saved notebook and renders in any front
  end. At most twice a second, and only when something new arrived; once more at the end.
- the health line, about every 2 s (output/health.py): for each rank its reports per second, resident memory,
  CPU use, on CUDA the GPU memory allocated and utilisation, its time per step split into working and waiting in
  collectives, and the rank the others wait for, named (output/straggler.py). With more than one rank, the chart
  has a last panel, each rank's share of its time spent waiting in collectives against the seconds since the
  first health figure: rank 0's line over the band of every rank's.

Both displays are published before any rank starts (:meth:`Board.start`), so they sit above
rank 0's text: a display arriving in the middle of a ``\r`` progress line would cut it in
two in the front end (the text after the display cannot redraw the line before it). A cell
that never reports keeps an empty chart output.

The kernel keeps the reports in bounded memory, each series a
:class:`~taas_magic.history.SeriesHistory` (taas_magic/history.py): per rank and metric its
values (and rank 0's steps), as numbers of 8 bytes, and rank 0's reports as they arrived, for
``taas.metrics()``. Each keeps every report up to ``RECENT + PAST`` (20,000); past that, the
first report, an evenly thinned past of at most ``PAST`` (10,000) reports (every 2nd, then
every 4th, ... report: always the first, evenly spaced), and the last ``RECENT`` (10,000)
reports exactly. A run reporting every step for two days holds what one reporting 20,000 times
does: at most 160 KB per rank and metric (320 KB on rank 0), and rank 0's reports as decoded
(about 350 bytes each with one metric, 1.4 KB with twelve): a million reports of one metric on
two ranks hold about 6 MB (tests/unit/test_board_bounded.py). The run's log on disk keeps every
report of rank 0 (output/runlog.py's ``points`` entries, given to it here as they arrive). The
band is drawn at points every rank keeps (histories with equal bounds keep the same indices up
to the shorter one's count, taas_magic/history.py); the health line needs each rank's last
few batches and health figures only.

``taas.metrics()`` in the notebook returns the last run's rank-0 reports (:meth:`Board.metrics`):
a list of dicts ``{"step": ..., metric: value, ...}`` in order, all of them up to 20,000, then
the first report, the evenly thinned past, and the last 10,000 reports exactly.
"""

from __future__ import annotations

import secrets
import time
from array import array
from dataclasses import dataclass, field
from html import escape
from operator import itemgetter
from typing import Callable

from taas_magic.history import SeriesHistory
from taas_magic.output.health import Health
from taas_magic.output.relay import Display, Publish
from taas_magic.output.reports import Report

CHART_SECONDS = 0.5
HEALTH_SECONDS = 2.0
WAITING = "waiting in collectives, % (x: seconds)"  # the chart's last panel (with more than one rank)
MAX_POINTS = 1000  # per line drawn: a longer series is thinned evenly
PANEL_WIDTH, PANEL_HEIGHT, MARGIN = 560, 150, 46
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf")


class _Series:
    """One metric of one rank: its values and (rank 0's: the chart's x) its steps, in report
    order, the same indices kept of both."""

    __slots__ = ("steps", "values")

    def __init__(self, steps: bool) -> None:
        self.steps: SeriesHistory[float] | None = SeriesHistory(typecode="d") if steps else None
        self.values: SeriesHistory[float] = SeriesHistory(typecode="d")

    def extend(self, steps: list, values: list) -> None:
        try:
            numbers = array("d", steps), array("d", values)
        except (TypeError, OverflowError):  # a value that is not a number: not drawn (the others are)
            pairs = [(step, value) for step, value in zip(steps, values)
                     if isinstance(step, (int, float)) and isinstance(value, (int, float))]
            numbers = array("d", [step for step, _ in pairs]), array("d", [value for _, value in pairs])
        if self.steps is not None:
            self.steps.extend(numbers[0])
        self.values.extend(numbers[1])


@dataclass
class _Rank:
    series: dict[str, _Series] = field(default_factory=dict)  # metric -> its steps and values
    reports: SeriesHistory[tuple] = field(default_factory=SeriesHistory)  # rank 0's (step, metrics), for taas.metrics()


class Board:
    def __init__(self, ranks: int, publish: Publish, points: Callable[[list], None] | None = None):
        self.ranks, self.publish = [_Rank() for _ in range(ranks)], publish
        self.health = Health(ranks)
        self.started = 0.0  # the first health figure's time, by the kernel's clock (the waiting panel's x)
        self.points = points  # rank 0's reports as they arrive, for the run log's record
        token = secrets.token_hex(4)
        self.chart_id, self.health_id = f"taas-chart-{token}", f"taas-health-{token}"
        self.shown: dict[str, dict] = {}  # display id -> the data it shows now
        self.dirty = False
        self.last_chart = self.last_health = 0.0

    def add(self, rank: int, batch: Report) -> None:
        """A rank's batch: its reports (and perhaps its health)."""
        record, reports = self.ranks[rank], batch.reports
        if reports:
            self.health.batch(rank, batch.at, len(reports))
            if rank == 0:
                if self.points is not None:
                    self.points(reports)  # every report: the run log keeps them all on disk
                record.reports.extend(reports)
            for name, (steps, values) in _columns(reports).items():
                series = record.series.get(name) or record.series.setdefault(name, _Series(steps=rank == 0))
                series.extend(steps, values)
            self.dirty = True
        if batch.health is not None:
            self.health.saw(rank, batch.health)
            self._waited(rank)

    def _waited(self, rank: int) -> None:
        """With rank 0's health, every rank's share of its last 2 s in collectives, to the chart's last panel (against
        the seconds since the first), once any rank has been in one: each rank's n-th point is at the same moment."""
        shares = self.health.waiting(latest=True)
        if rank != 0 or len(shares) < max(2, len(self.ranks)):
            return
        if not any(figures.get("collective") for figures in self.health.last().values()):
            return
        now = time.monotonic()
        self.started = self.started or now
        for each, share in shares.items():
            series = self.ranks[each].series.get(WAITING) or self.ranks[each].series.setdefault(WAITING, _Series(each == 0))
            series.extend([round(now - self.started, 1)], [100 * share])
        self.dirty = True

    def start(self) -> None:
        """The two displays above the ranks' output, before any rank runs, once (background.py's begin may go first)."""
        if not self.shown:
            self.last_health = time.monotonic()
            self._publish(self.health_id, {"text/plain": f"taas health · starting {len(self.ranks)} rank(s)"})
            self._publish(self.chart_id, {"text/plain": ""})

    def metrics(self) -> list[dict]:
        """Rank 0's reports as kept (see the module docstring), each ``{"step": ..., metric: value}``."""
        return [{"step": step, **metrics} for step, metrics in self.ranks[0].reports]

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.dirty and (force or now - self.last_chart >= CHART_SECONDS):
            self.dirty, self.last_chart = False, now
            svg = self.chart()
            if svg is not None:
                self._publish(self.chart_id, {"image/svg+xml": svg, "text/plain": self._chart_text()})
        if self.health.any() and (force or now - self.last_health >= HEALTH_SECONDS):
            self.last_health = now
            self._publish(self.health_id, {"text/plain": self.health.line()})

    def _publish(self, display_id: str, data: dict) -> None:
        if self.shown.get(display_id) == data:  # it shows that already: a message spared
            return
        self.publish(Display(data, {}, {"display_id": display_id}, display_id in self.shown))
        self.shown[display_id] = data

    def _chart_text(self) -> str:
        reports = self.ranks[0].reports
        last = {"step": reports.last[0], **reports.last[1]} if reports.count else {}
        return "taas chart · " + ", ".join(f"{name} {value:.4g}" for name, value in last.items())

    # -- the chart ---------------------------------------------------------------------------
    def chart(self) -> str | None:
        names = sorted(self.ranks[0].series, key=lambda name: name == WAITING)  # the waiting panel last
        if not names:
            return None
        panels = [self._panel(name, index) for index, name in enumerate(names)]
        height = PANEL_HEIGHT * len(panels)
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{PANEL_WIDTH}" height="{height}" '
                f'viewBox="0 0 {PANEL_WIDTH} {height}" font-family="sans-serif" font-size="11">'
                '<rect width="100%" height="100%" fill="white"/>' + "".join(panels) + "</svg>")

    def _panel(self, name: str, index: int) -> str:
        steps, values = self.ranks[0].series[name].steps, self.ranks[0].series[name].values
        assert steps is not None  # rank 0's series keep their steps
        band = self._band(name)  # (index, lowest, highest), thinned
        lows = [low for _, low, _ in band] if band else values
        highs = [high for _, _, high in band] if band else values
        low, high = min(min(lows), min(values)), max(max(highs), max(values))
        if high == low:
            low, high = low - 0.5, high + 0.5
        first, last = steps.first, steps.last if steps.last != steps.first else steps.first + 1
        top = index * PANEL_HEIGHT
        left, right, upper, lower = MARGIN, PANEL_WIDTH - 10, top + 18, top + PANEL_HEIGHT - 22

        def x(step: float) -> float:
            return left + (step - first) / (last - first) * (right - left)

        def y(value: float) -> float:
            return lower - (value - low) / (high - low) * (lower - upper)

        parts = [f'<text x="{left}" y="{top + 13}" font-weight="bold">{escape(name)}</text>',
                 f'<text x="{right}" y="{top + 13}" text-anchor="end">rank 0: {values.last:.4g}'
                 + (" (band: every rank's min-max)" if band else "") + "</text>",
                 f'<rect x="{left}" y="{upper}" width="{right - left}" height="{lower - upper}" fill="none" stroke="#ccc"/>']
        for value in (low, (low + high) / 2, high):
            parts.append(f'<text x="{left - 4}" y="{y(value) + 4:.1f}" text-anchor="end">{value:.3g}</text>')
        for step in (first, last):
            parts.append(f'<text x="{x(step):.1f}" y="{lower + 14}" text-anchor="middle">{step:g}</text>')
        colour = COLOURS[index % len(COLOURS)]
        if band:
            upper_edge = " ".join(f"{x(steps.at(i)):.1f},{y(high):.1f}" for i, _, high in band)
            lower_edge = " ".join(f"{x(steps.at(i)):.1f},{y(low):.1f}" for i, low, _ in reversed(band))
            parts.append(f'<polygon points="{upper_edge} {lower_edge}" fill="{colour}" fill-opacity="0.2" stroke="none"/>')
        line = " ".join(f"{x(steps.at(i)):.1f},{y(values.at(i)):.1f}" for i in values.thinned(MAX_POINTS))
        parts.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        return "".join(parts)

    def _band(self, name: str) -> list[tuple[int, float, float]]:
        """(report index, lowest, highest) over the ranks where every rank reports ``name``, at
        the points drawn only (a run of 100,000 reports costs a thousand, not 100,000, each time).
        The indices are those the rank with the most reports keeps (the most thinned): every rank
        keeps them, up to the fewest reports of any rank (taas_magic/history.py)."""
        if len(self.ranks) < 2 or not all(name in record.series for record in self.ranks):
            return []
        series = [record.series[name].values for record in self.ranks]
        length = min(values.count for values in series)
        coarsest = max(series, key=lambda values: values.count)
        band = []
        for i in coarsest.thinned(MAX_POINTS, below=length):
            if all(values.kept(i) for values in series):
                at = [values.at(i) for values in series]
                band.append((i, min(at), max(at)))
        return band

def _columns(reports: list[tuple]) -> dict[str, tuple[list, list]]:
    """A batch's steps and values by metric, in report order (for a metric some reports leave
    out, the steps of those that have it)."""
    names = list(reports[0][1])
    every = [metrics for _, metrics in reports]
    if sum(map(len, every)) == len(names) * len(every):  # the usual batch: the same metrics in every report
        try:
            steps = list(map(itemgetter(0), reports))
            return {name: (steps, list(map(itemgetter(name), every))) for name in names}
        except KeyError:
            pass  # as many metrics, not the same ones
    columns: dict[str, tuple[list, list]] = {}
    for step, metrics in reports:
        for name, value in metrics.items():
            column = columns.get(name) or columns.setdefault(name, ([], []))
            column[0].append(step)
            column[1].append(value)
    return columns


def health_by_rank(board: Board) -> dict[int, dict]:
    """Each rank's last health figures (cpu, rss, gpu_memory), for the ranks that sent any (kept ranks' memory)."""
    return board.health.last()
