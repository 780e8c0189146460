"""The kernel's half of ``--profile``: every rank's trace merged into one Chrome/Perfetto file, bounded, saved.

Runs in the kernel, on the run's own thread, as the run releases its parts (kernel/runs/run.py).

What is written, in the notebook's folder (the kernel's working directory, where Jupyter starts it), one folder per
run, owner-only (0700, its files 0600, each landing whole through ``os.replace``)::

    taas-profiles/<time>-<run id>/
        trace.json          every rank merged: open it in Perfetto (ui.perfetto.dev) or chrome://tracing
        ranks/rank<K>.json  each rank alone, as Kineto wrote it (``distributedInfo.rank``): HTA's
                            ``TraceAnalysis(trace_dir=".../ranks")`` reads this folder

The merge. Each rank is one process, ``pid`` K, named ``rank K`` and sorted by K (every event of the rank, its CPU
threads and its GPU streams, moves into it; a flow's ``id`` is made unique per rank). Kineto writes times as
microseconds after the trace's ``baseTimeNanoseconds`` on the rank's wall clock (``CLOCK_REALTIME``). Ranks on the
kernel's host read the kernel's own clock, so their times are used as they are (off by nothing). Ranks of a cluster
engine (Ray, Slurm: perhaps on other hosts) are moved by their measured offset from the kernel's clock
(profiling/window.py: the best of five round trips over the rank's channel); that offset can be off by half that
round trip, written per rank in the file's ``taas`` metadata (``clock_bound_us``) and said in the cell when it is
over a millisecond. The merged times start at 0 at the earliest event of any rank (``baseTimeNanoseconds`` then
says when that was on the kernel's clock).

The bound. The merged file is at most ``MAX_BYTES`` (200 MB; the ``ranks/`` copies hold as much again). Each rank
fits its own trace to its share of that before sending it (bound.py says what goes first), so the kernel never
holds more; the merge fits each rank again as a last guard (the names it adds). The cell says how many events were
dropped, and the metadata counts them.
"""

from __future__ import annotations

import gzip
import json
import os
import time
from dataclasses import dataclass, field

from taas_magic.profiling.bound import MAX_BYTES, fit

FOLDER = "taas-profiles"
_RANK_META = ("process_name", "process_labels", "process_sort_index")


@dataclass
class RankTrace:
    """One rank's trace as it came (profiling/window.py's ProfileTrace), decoded."""

    rank: int
    trace: dict
    host: str
    offset_ns: int  # the kernel's clock minus the rank's
    bound_ns: int  # how far off that can be
    steps: int
    whole: bool

    @classmethod
    def decode(cls, rank: int, data: bytes, host: str, clock: tuple[int, int], marks: tuple[int, bool]) -> RankTrace:
        return cls(rank, json.loads(gzip.decompress(data)), host, clock[0], clock[1], marks[0], marks[1])


@dataclass
class Merged:
    """The merged trace, and each rank's events in it (the same dicts), with what was dropped to fit."""

    trace: dict
    per_rank: dict[int, list[dict]]
    dropped: int = 0
    notes: list[str] = field(default_factory=list)


def merge(traces: list[RankTrace], measured_clocks: bool, limit: int = MAX_BYTES) -> Merged:
    """One trace of every rank (module docstring); ``measured_clocks``: move each rank by its measured offset
    (the ranks may be on other hosts), else use their times as they are (all on the kernel's host)."""
    starts = {}
    for one in traces:
        offset = one.offset_ns if measured_clocks else 0
        base = int(one.trace.get("baseTimeNanoseconds", 0)) + offset
        first = min((float(e["ts"]) for e in one.trace.get("traceEvents", []) if "ts" in e and e.get("ph") != "M"),
                    default=0.0)
        starts[one.rank] = (base, first)
    origin = min((base + int(first * 1000) for base, first in starts.values()), default=0)
    per_rank: dict[int, list[dict]] = {}
    for one in sorted(traces, key=lambda t: t.rank):
        base, _ = starts[one.rank]
        per_rank[one.rank] = _moved(one.rank, one.trace.get("traceEvents", []), (base - origin) / 1000)
    merged = Merged({}, per_rank)
    share = max(1, limit // max(1, len(per_rank)) - 4096)  # the rank's names, the file's metadata
    for rank, events in per_rank.items():
        per_rank[rank], dropped = fit(events, share)
        merged.dropped += dropped
    bounds = {one.rank: (one.bound_ns if measured_clocks else 0) for one in traces}
    unmeasured = sorted(rank for rank, bound in bounds.items() if bound < 0)
    worst = max(bounds.values(), default=0)
    if worst > 1_000_000:
        merged.notes.append(f"clocks aligned to within {worst / 1e6:.1f} ms (measured over the ranks' channels)")
    if unmeasured:
        merged.notes.append(f"rank(s) {', '.join(map(str, unmeasured))}: the kernel's clock did not answer; their "
                            "times are as their own hosts' clocks read them")
    events = [event for rank in sorted(per_rank) for event in _names(rank) + per_rank[rank]]
    merged.trace = {
        "traceEvents": events, "displayTimeUnit": "ms", "baseTimeNanoseconds": origin,
        "taas": {"clocks": "measured offset, best of 5 round trips" if measured_clocks else "one host: one clock",
                 "clock_bound_us": {str(rank): bound / 1000 for rank, bound in bounds.items()},
                 "hosts": {str(one.rank): one.host for one in traces},
                 "steps": {str(one.rank): one.steps for one in traces},
                 "whole_cell": all(one.whole for one in traces), "dropped_events": merged.dropped},
    }
    return merged


def _moved(rank: int, events: list[dict], shift_us: float) -> list[dict]:
    """The rank's events in process ``rank``, on the merged clock; Kineto's own process names left out."""
    moved = []
    for event in events:
        if event.get("ph") == "M" and event.get("name") in _RANK_META:
            continue
        event = dict(event, pid=rank)
        if "ts" in event:
            event["ts"] = round(float(event["ts"]) + shift_us, 3)
        if isinstance(event.get("id"), int):
            event["id"] = event["id"] + (rank << 40)  # flows stay within their rank
        moved.append(event)
    return moved


def _names(rank: int) -> list[dict]:
    return [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]


def save(merged: Merged, traces: list[RankTrace], folder: str, run_id: str) -> str:
    """The run's folder in ``folder`` (module docstring), owner-only; the merged file's path."""
    run = os.path.join(folder, FOLDER, f"{time.strftime('%Y%m%d-%H%M%S')}-{run_id}")
    os.makedirs(os.path.join(run, "ranks"), mode=0o700, exist_ok=True)
    os.chmod(os.path.join(folder, FOLDER), 0o700)
    os.chmod(run, 0o700)
    for one in traces:
        alone = dict(one.trace, traceEvents=merged.per_rank.get(one.rank, []),
                     baseTimeNanoseconds=merged.trace["baseTimeNanoseconds"])
        _land(os.path.join(run, "ranks", f"rank{one.rank}.json"), alone)
    path = os.path.join(run, "trace.json")
    _land(path, merged.trace)
    return path


def _land(path: str, trace: dict) -> None:
    """``trace`` written beside ``path`` and moved into place: whole, owner-only."""
    temporary = f"{path}.partial"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        json.dump(trace, file)
    os.replace(temporary, path)
