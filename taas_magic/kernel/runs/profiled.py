"""A ``--profile`` run's traces, gathered as the ranks send them, then merged, saved and told in the cell.

Runs in the kernel, on the run's own thread: :meth:`Profiles.add` as a rank's trace arrives (the supervisor routes
it), :meth:`Profiles.finish` as the run releases its parts (kernel/runs/run.py), before its log's last entry.

It composes two features: profiling/ (the merge, the file, each rank's breakdown) and output/straggler.py (the rank
the others wait for, from each rank's communicating share), which do not import each other.
"""

from __future__ import annotations

import os
from typing import Callable

from taas_magic.output.straggler import straggler
from taas_magic.profiling.bound import MAX_BYTES
from taas_magic.profiling.merge import RankTrace, merge, save
from taas_magic.profiling.window import ProfileTrace


class Profiles:
    """One run's traces (module docstring)."""

    def __init__(self, ranks: int, steps: int, measured_clocks: bool, run_id: str):
        """``steps``: N of ``--profile N``; ``measured_clocks``: the ranks may be on other hosts (a cluster engine)."""
        self.ranks, self.steps, self.measured_clocks, self.run_id = ranks, steps, measured_clocks, run_id
        self.frames: dict[int, ProfileTrace] = {}

    def add(self, rank: int, frame: ProfileTrace) -> None:
        """A rank's trace, kept as it came until the run ends (a later attempt's replaces an earlier one's)."""
        self.frames[rank] = frame

    def finish(self, say: Callable[[str], None], folder: str | None = None) -> None:
        """Merge, save in ``folder`` (the notebook's: the kernel's working directory), and ``say`` what it shows."""
        if not self.frames:
            say("--profile: no rank sent its trace (a cell that fails or is stopped is not profiled)")
            return
        try:
            traces = [RankTrace.decode(rank, frame.data, frame.host, (frame.offset_ns, frame.bound_ns),
                                       (frame.steps, frame.whole)) for rank, frame in sorted(self.frames.items())]
            merged = merge(traces, self.measured_clocks)
        except Exception as error:  # noqa: BLE001 - a trace we cannot read costs its profile, never the run's results
            say(f"--profile: could not merge the ranks' traces: {type(error).__name__}: {error}")
            return
        try:
            path = save(merged, traces, folder or os.getcwd(), self.run_id)
        except OSError as error:
            say(f"--profile: could not save the trace in {folder or os.getcwd()}: {error}")
            return
        size = os.path.getsize(path) / 1e6
        whole = all(trace.whole for trace in traces)
        steps = f"{self.steps} step{'s' if self.steps > 1 else ''} after the first"
        window = "the whole cell (fewer step marks than the window)" if whole else steps
        say(f"--profile: {window}, {len(traces)} of {self.ranks} ranks: {path} ({size:.1f} MB; "
            f"ui.perfetto.dev opens it; HTA reads {os.path.join(os.path.dirname(path), 'ranks')})")
        missing = sorted(set(range(self.ranks)) - set(self.frames))
        if missing:
            say(f"--profile: no trace from rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
        dropped = merged.dropped + sum(frame.dropped for frame in self.frames.values())
        if dropped:
            say(f"--profile: {dropped} of the shortest events dropped to keep the file under {MAX_BYTES / 1e6:.0f} MB")
        for note in merged.notes:
            say(f"--profile: {note}")
        times = [frame.time for _, frame in sorted(self.frames.items())]  # each rank's, from all its events
        for time in times:
            say("  " + time.line())
        slow = straggler({time.rank: time.communicating for time in times if time.window_us > 0})
        if slow is not None:
            say("  " + slow.line())
