"""What the cell shows of a search: one table and one chart, updated in place, and the best trial's last lines.

Runs in the kernel, on the search's own thread (kernel/trials/searchrun.py).

The search (kernel/trials/searchrun.py) hands :func:`search_display` a :class:`TrialRow` per trial
asked so far and gets two displays' data, each published under its own display id
(``update_display_data`` after the first), when something changed, at most twice a second,
and once more at the end:

- the table: ``text/html`` (trial, params, state, last and best value of the objective,
  seconds, the best trial's row in bold, then the best trial's last lines of rank 0's output)
  and ``text/plain``, the same as text, for a front end without HTML and the saved notebook;
- the chart: ``image/svg+xml`` drawn here (as the run's chart, output/board.py: no plotting
  library), one line per trial of the objective against its step, the best trial's thicker.
  The run log leaves an SVG out of its file on disk (its points are there), so a long search's
  log grows with its table, not with its chart.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any

WIDTH, HEIGHT, MARGIN = 560, 200, 46
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
MOST_POINTS = 300  # per trial's line: a longer curve is thinned evenly


@dataclass(frozen=True)
class TrialRow:
    number: int
    params: dict
    state: str  # running, complete, pruned, failed, stopped
    last: float | None  # the objective's last value rank 0 reported
    best: float | None  # its best value so far (lowest, or highest with --maximize)
    seconds: float
    curve: tuple[tuple[float, float], ...] = ()  # (step, value)


def search_display(rows: list[TrialRow], objective: str, best: int | None, lines: list[str]) -> tuple[dict, dict | None]:
    """The two displays' data: the table with the best trial's last ``lines``, and the chart (None
    before any trial reported the objective)."""
    html = _table_html(rows, objective, best)
    text = table_text(rows, objective, best)
    if lines:
        html += f"<div>trial {best}'s last lines:</div><pre>{escape(chr(10).join(lines))}</pre>"
        text += f"\ntrial {best}'s last lines:\n" + "\n".join(lines)
    svg = _chart(rows, objective, best)
    chart = {"image/svg+xml": svg, "text/plain": f"taas chart · {objective} of {len(rows)} trial(s)"} if svg else None
    return {"text/html": html, "text/plain": text}, chart


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.5g}"


def _params(params: dict) -> str:
    return ", ".join(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
                     for name, value in params.items())


def table_text(rows: list[TrialRow], objective: str, best: int | None) -> str:
    header = ("trial", "params", "state", f"last {objective}", f"best {objective}", "seconds")
    cells = [header] + [(("*" if row.number == best else "") + str(row.number), _params(row.params), row.state,
                         _number(row.last), _number(row.best), f"{row.seconds:.1f}") for row in rows]
    widths = [max(len(line[column]) for line in cells) for column in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells)


def _table_html(rows: list[TrialRow], objective: str, best: int | None) -> str:
    head = "".join(f"<th>{escape(title)}</th>" for title in
                   ("trial", "params", "state", f"last {objective}", f"best {objective}", "seconds"))
    body = []
    for row in rows:
        style = ' style="font-weight:bold"' if row.number == best else ""
        cells = (str(row.number), _params(row.params), row.state, _number(row.last), _number(row.best), f"{row.seconds:.1f}")
        body.append(f"<tr{style}>" + "".join(f"<td>{escape(cell)}</td>" for cell in cells) + "</tr>")
    return f'<table class="taas-trials"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _chart(rows: list[TrialRow], objective: str, best: int | None) -> str:
    curves = [(row.number, row.curve) for row in rows if row.curve]
    if not curves:
        return ""
    steps = [step for _, curve in curves for step, _ in curve]
    values = [value for _, curve in curves for _, value in curve]
    first, last = min(steps), max(steps)
    low, high = min(values), max(values)
    last = last if last != first else first + 1
    low, high = (low - 0.5, high + 0.5) if high == low else (low, high)
    left, right, upper, lower = MARGIN, WIDTH - 10, 18, HEIGHT - 22

    def point(step: float, value: float) -> str:
        x = left + (step - first) / (last - first) * (right - left)
        y = lower - (value - low) / (high - low) * (lower - upper)
        return f"{x:.1f},{y:.1f}"

    parts = [f'<text x="{left}" y="13" font-weight="bold">{escape(objective)} per trial</text>',
             f'<rect x="{left}" y="{upper}" width="{right - left}" height="{lower - upper}" fill="none" stroke="#ccc"/>']
    for value in (low, (low + high) / 2, high):
        parts.append(f'<text x="{left - 4}" y="{lower - (value - low) / (high - low) * (lower - upper) + 4:.1f}" '
                     f'text-anchor="end">{value:.3g}</text>')
    for number, curve in curves:
        kept = curve if len(curve) <= MOST_POINTS else \
            [curve[i * len(curve) // MOST_POINTS] for i in range(MOST_POINTS)] + [curve[-1]]
        width = 3 if number == best else 1.2
        colour = COLOURS[number % len(COLOURS)]
        parts.append(f'<polyline points="{" ".join(point(s, v) for s, v in kept)}" fill="none" stroke="{colour}" '
                     f'stroke-width="{width}"><title>trial {number}</title></polyline>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" '
            f'font-family="sans-serif" font-size="11"><rect width="100%" height="100%" fill="white"/>{"".join(parts)}</svg>')


def trials_frame(records: list[dict]) -> Any:
    """``taas.trials()``'s value: a pandas DataFrame of ``records`` (number, params, value, state,
    seconds, log) where pandas is installed, else the list of dicts itself."""
    try:
        import pandas
    except ImportError:
        return records
    return pandas.DataFrame.from_records(records, columns=["number", "params", "value", "state", "seconds", "log"])
