"""A trace held to a size: what ``--profile`` drops when a window recorded more than the file may hold.

Runs in each rank, on the cell's thread, before its trace is sent (profiling/window.py: its share, ``MAX_BYTES``
over the world's size, so the kernel never holds more than one file's worth), and in the kernel as the merge's
last guard (merge.py).

What goes, until the events fit, in this order:

1. the shortest complete events (``"ph": "X"``; operator calls first among equals), with every flow arrow
   (``"s"``/``"t"``/``"f"``, by ``id``) that starts or ends on one of them: no arrow is left pointing nowhere;
2. if that was not enough (a trace of little but counters and flows): the counters (``"C"``), then the flows.

Never dropped: metadata (``"M"``) and the ``ProfilerStep#k`` spans. Sizes are each event's JSON bytes, in decimal
megabytes as the cell prints them (200 MB is 200,000,000 bytes).
"""

from __future__ import annotations

import json

MAX_BYTES = 200_000_000  # the merged file at most (its ranks/ copies hold as much again)
FLOWS = ("s", "t", "f")


def fit(events: list[dict], limit: int) -> tuple[list[dict], int]:
    """``events`` (one rank's, or every rank's) in at most ``limit`` bytes of JSON; how many were dropped."""
    total = len(json.dumps(events))
    if total <= limit:
        return events, 0
    sizes = {id(event): len(json.dumps(event)) + 2 for event in events}
    flows: dict[tuple, list[dict]] = {}
    ends: dict[tuple, list[dict]] = {}  # the flow events at a slice's start, on its thread
    for event in events:
        if event.get("ph") in FLOWS:
            flows.setdefault((event.get("cat"), event.get("id")), []).append(event)
            ends.setdefault((event.get("pid"), event.get("tid"), event.get("ts")), []).append(event)
    gone: set[int] = set()

    def drop(event: dict) -> None:
        nonlocal total
        if id(event) not in gone:
            gone.add(id(event))
            total -= sizes[id(event)]

    slices = [event for event in events
              if event.get("ph") == "X" and not str(event.get("name", "")).startswith("ProfilerStep#")]
    slices.sort(key=lambda event: (float(event.get("dur", 0)), event.get("cat") != "cpu_op"))
    rest = [event for event in events if event.get("ph") == "C"] + [event for event in events if event.get("ph") in FLOWS]
    for event in slices:
        if total <= limit:
            break
        drop(event)
        for arrow in ends.get((event.get("pid"), event.get("tid"), event.get("ts")), ()):
            for part in flows[(arrow.get("cat"), arrow.get("id"))]:
                drop(part)
    for event in rest:
        if total <= limit:
            break
        drop(event)
        for part in flows.get((event.get("cat"), event.get("id")), ()) if event.get("ph") in FLOWS else ():
            drop(part)
    return [event for event in events if id(event) not in gone], len(gone)
