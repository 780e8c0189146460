"""Each rank's time in its profiled window: working, communicating, idle waiting, and its top five operations.

Runs in each rank, on the cell's thread, from its own window's every event (profiling/window.py), before any is
dropped to fit the file (bound.py); the kernel says it in the cell (kernel/runs/profiled.py).

Over the rank's window (its first event's start to its last event's end), every instant is one of:

- *communicating*: some thread of the rank is inside a collective (an event named for one: ``c10d::``, ``gloo:``,
  ``nccl``, ``record_param_comms``, ``all_reduce``, ``broadcast``, ``barrier``, ...), gloo's and NCCL's own
  threads and streams included, and the rank's main thread is not working;
- *working*: the rank's main thread (the one with the ``ProfilerStep#k`` spans, else the busiest) is inside an
  operator (``cpu_op``) or a user annotation that is not a collective; on CUDA, a GPU kernel that is not a
  collective also counts;
- *idle waiting*: neither: Python between operators, ``time.sleep``, waiting on something the profiler does not name.

The top five operations are the operators (``cpu_op``, and GPU ``kernel``) of the most *self* time: an event's
duration less that of the events directly inside it on the same thread.

The communicating share is each rank's waiting in collectives: output/straggler.py names the rank the others wait
for from it (the kernel stage puts the two together).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

COLLECTIVE = re.compile(r"c10d::|gloo|nccl|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|broadcast|"
                        r"barrier|all_?to_?all", re.IGNORECASE)
WORK = ("cpu_op", "user_annotation", "kernel", "gpu_memcpy", "gpu_memset")
TOP = 5


@dataclass(frozen=True)
class RankTime:
    """One rank's window, split."""

    rank: int
    window_us: float
    working: float  # shares of the window, 0..1
    communicating: float
    idle: float
    top: tuple[tuple[str, float], ...]  # (operator, self time in µs), the most first

    def line(self) -> str:
        top = ", ".join(f"{name} {_duration(us)}" for name, us in self.top)
        return (f"rank {self.rank}: working {100 * self.working:.0f}%, communicating {100 * self.communicating:.0f}%, "
                f"idle {100 * self.idle:.0f}% of {_duration(self.window_us)}; top: {top or 'no operators'}")


def _duration(us: float) -> str:
    return f"{us / 1000:.1f} ms" if us >= 1000 else f"{us:.0f} µs"


def rank_time(rank: int, events: list[dict]) -> RankTime:
    """``events``: one rank's events, as Kineto wrote them."""
    spans = [event for event in events if event.get("ph") == "X" and "dur" in event]
    if not spans:
        return RankTime(rank, 0.0, 0.0, 0.0, 0.0, ())
    start = min(float(e["ts"]) for e in spans)
    end = max(float(e["ts"]) + float(e["dur"]) for e in spans)
    window = max(end - start, 1e-9)
    main = _main_thread(spans)
    collective = [_span(e) for e in spans if COLLECTIVE.search(str(e.get("name", "")))]
    work = [_span(e) for e in spans if e.get("cat") in WORK and not COLLECTIVE.search(str(e.get("name", "")))
            and (e.get("tid") == main or e.get("cat") == "kernel")
            and not str(e.get("name", "")).startswith("ProfilerStep#")]
    working = _length(work)
    either = _length(work + collective)
    return RankTime(rank, window, working / window, (either - working) / window, max(0.0, 1 - either / window),
                    _top(spans))


def _main_thread(spans: list[dict]) -> object:
    steps = [e.get("tid") for e in spans if str(e.get("name", "")).startswith("ProfilerStep#")]
    if steps:
        return steps[0]
    busy: dict[object, float] = defaultdict(float)
    for event in spans:
        if event.get("cat") == "cpu_op":
            busy[event.get("tid")] += float(event["dur"])
    return max(busy, key=busy.__getitem__, default=None)


def _span(event: dict) -> tuple[float, float]:
    return float(event["ts"]), float(event["ts"]) + float(event["dur"])


def _length(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``spans``."""
    total, reach = 0.0, float("-inf")
    for begin, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(begin, reach)
        reach = end
    return total


def _top(spans: list[dict]) -> tuple[tuple[str, float], ...]:
    """The operators of the most self time."""
    own: dict[str, float] = defaultdict(float)
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for event in spans:
        if event.get("cat") in ("cpu_op", "kernel"):
            by_thread[(event.get("pid"), event.get("tid"))].append(event)
    for thread in by_thread.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[tuple[float, str]] = []  # (end, name) of the enclosing events
        for event in thread:
            begin, end = _span(event)
            while stack and stack[-1][0] <= begin:
                stack.pop()
            if stack:
                own[stack[-1][1]] -= float(event["dur"])  # the parent's self time excludes its direct children
            own[str(event["name"])] += float(event["dur"])
            stack.append((end, str(event["name"])))
    ranked = sorted(own.items(), key=lambda item: -item[1])[:TOP]
    return tuple((name, us) for name, us in ranked if us > 0)
