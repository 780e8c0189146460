"""--profile's halves without a kernel: the rank's window over a real torch.profiler, the merge (clocks, names, the
size bound, the files) and the breakdown, on traces built by hand where the numbers must be exact."""

import gzip
import json
import os
import stat
from pathlib import Path

from taas_magic.kernel.runs.profiled import Profiles
from taas_magic.profiling import window
from taas_magic.profiling.bound import fit
from taas_magic.profiling.breakdown import rank_time
from taas_magic.profiling.merge import RankTrace, merge, save
from taas_magic.profiling.window import ClockAsk, ClockTime, ProfileTrace


def _x(name, ts, dur, tid=1, cat="cpu_op", **more):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 99, "tid": tid, "cat": cat, **more}


def _trace(rank, base_ns, events, offset_ns=0, bound_ns=0):
    meta = [{"ph": "M", "name": "process_name", "pid": 99, "tid": 0, "args": {"name": "python"}}]
    return RankTrace(rank, {"baseTimeNanoseconds": base_ns, "traceEvents": meta + events,
                            "distributedInfo": {"rank": rank}}, f"host{rank}", offset_ns, bound_ns, 4, False)


def test_the_window_keeps_n_steps_after_the_first_then_stops_and_removes_its_hook():
    import torch
    from torch.optim.optimizer import _global_optimizer_post_hooks as hooks

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    window.begin(2, cuda=False)
    for _ in range(5):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        window.mark("report")  # a loop that also reports: its steps are counted once, by the optimizer
    ended = window.end()
    assert ended is not None and ended.marks == 3 and not ended.recording and not hooks
    assert window.end() is None  # torn down once
    sent = []
    ended.send(sent.append, lambda frame, kind: ClockTime(0), rank=1, world=2)
    (frame,) = sent
    assert isinstance(frame, ProfileTrace) and not frame.whole and frame.steps == 3 and frame.dropped == 0
    assert frame.time.rank == 1 and frame.time.window_us > 0 and frame.time.top  # split on the rank, from every event
    trace = json.loads(gzip.decompress(frame.data))
    names = {event.get("name") for event in trace["traceEvents"]}
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= names and "ProfilerStep#0" not in names
    assert trace["distributedInfo"]["rank"] == 1


def test_the_clock_offset_is_the_probe_of_the_shortest_round_trip():
    asked = []

    def ask(frame, kind):
        asked.append(frame)
        return kind(10**18)

    offset, bound = window.clock_offset(ask)
    assert len(asked) == window.CLOCK_PROBES and all(isinstance(frame, ClockAsk) for frame in asked)
    assert 0 <= bound < 10**9 and abs(offset - (10**18 - window.time.time_ns())) < 10**9
    assert window.clock_offset(lambda frame, kind: None) == (0, -1)  # the kernel never answered: unknown, not a hang


def test_the_merge_names_each_rank_aligns_its_clock_and_keeps_flows_apart():
    zero = _trace(0, 1_000_000_000, [_x("a", 10.0, 5.0), {"ph": "s", "id": 7, "ts": 11.0, "pid": 99, "tid": 1}])
    one = _trace(1, 1_000_000_000, [_x("a", 10.0, 5.0), {"ph": "s", "id": 7, "ts": 11.0, "pid": 99, "tid": 1}],
                 offset_ns=2_000_000, bound_ns=3_000_000)  # its clock is 2 ms behind the kernel's
    same_host = merge([zero, one], measured_clocks=False)
    assert [e["ts"] for e in same_host.per_rank[1] if e["ph"] == "X"] == [0.0]  # one clock: as they are
    measured = merge([zero, one], measured_clocks=True)
    assert [e["ts"] for e in measured.per_rank[0] if e["ph"] == "X"] == [0.0]
    assert [e["ts"] for e in measured.per_rank[1] if e["ph"] == "X"] == [2000.0]
    assert measured.trace["baseTimeNanoseconds"] == 1_000_010_000
    assert measured.trace["taas"]["clock_bound_us"] == {"0": 0.0, "1": 3000.0}
    assert measured.notes == ["clocks aligned to within 3.0 ms (measured over the ranks' channels)"]
    names = {(e["pid"], e["args"]["name"]) for e in measured.trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}  # Kineto's own "python" is gone
    assert len({e["id"] for e in measured.trace["traceEvents"] if e["ph"] == "s"}) == 2


def test_a_merge_over_the_bound_drops_the_shortest_events_never_the_steps():
    events = [_x("ProfilerStep#1", 0.0, 0.5)] + [_x(f"op{k}", float(k), float(k)) for k in range(1, 200)]
    merged = merge([_trace(0, 0, events)], measured_clocks=False, limit=12_000)
    kept = [e for e in merged.per_rank[0] if e["ph"] == "X"]
    assert merged.dropped > 0 and len(kept) == 200 - merged.dropped
    assert kept[0]["name"] == "ProfilerStep#1"  # the shortest of all, kept
    assert min(e["dur"] for e in kept[1:]) > max(float(k) for k in range(1, 200) if f"op{k}" not in
                                                  {e["name"] for e in kept}) - 1e-9
    assert len(json.dumps(merged.trace)) <= 12_000
    assert merged.trace["taas"]["dropped_events"] == merged.dropped


def test_a_rank_cut_to_its_share_drops_the_arrows_on_dropped_slices_then_counters():
    events = [{"ph": "M", "name": "thread_name", "pid": 99, "tid": 1, "args": {"name": "main"}},
              _x("ProfilerStep#1", 0.0, 0.5, cat="user_annotation"), _x("aten::add", 1.0, 1.0),
              _x("aten::mm", 3.0, 90.0), _x("aten::mm_backward", 100.0, 80.0),
              {"ph": "s", "id": 1, "cat": "fwdbwd", "ts": 1.0, "pid": 99, "tid": 1},  # from add...
              {"ph": "f", "id": 1, "cat": "fwdbwd", "ts": 100.0, "pid": 99, "tid": 1, "bp": "e"}]  # ...to its backward
    counters = [{"ph": "C", "name": "memory", "ts": float(k), "pid": 99, "tid": 1, "args": {"bytes": k}}
                for k in range(40)]
    kept, dropped = fit(events, len(json.dumps(events)) - 10)  # the shortest slice goes, and the arrow on it
    assert dropped == 3 and [e["name"] for e in kept if e["ph"] == "X"] == ["ProfilerStep#1", "aten::mm",
                                                                               "aten::mm_backward"]
    assert not [e for e in kept if e["ph"] in ("s", "f")]
    tiny = len(json.dumps([events[0], events[1]])) + 2
    kept, dropped = fit(events + counters, tiny)  # slices, then counters, then flows: only what is never dropped
    assert [e["ph"] for e in kept] == ["M", "X"] and dropped == len(events) + len(counters) - 2


def test_the_breakdown_splits_the_window_and_ranks_operators_by_self_time():
    events = [_x("ProfilerStep#1", 0.0, 100.0, cat="user_annotation"),
              _x("aten::linear", 0.0, 30.0), _x("aten::addmm", 5.0, 20.0),  # linear's self time: 10
              _x("gloo:all_reduce", 30.0, 50.0, tid=2, cat="user_annotation")]  # on gloo's thread
    split = rank_time(0, [dict(e, pid=0) for e in events])
    assert (split.working, split.communicating, round(split.idle, 6)) == (0.3, 0.5, 0.2)
    assert split.top == (("aten::addmm", 20.0), ("aten::linear", 10.0))
    assert split.line() == ("rank 0: working 30%, communicating 50%, idle 20% of 100 µs; "
                            "top: aten::addmm 20 µs, aten::linear 10 µs")


def test_the_run_saves_owner_only_files_and_names_the_rank_the_others_wait_for(tmp_path):
    def one(rank, waits):
        events = [_x("ProfilerStep#1", 0.0, 100.0, cat="user_annotation"), _x("aten::mm", 0.0, 100.0 - waits),
                  _x("gloo:all_reduce", 100.0 - waits, waits, tid=2, cat="user_annotation")]
        data = gzip.compress(json.dumps({"baseTimeNanoseconds": 0, "traceEvents": events}).encode())
        return ProfileTrace(data, "here", 0, 0, 4, False, rank_time(rank, events), 0)

    profiles, said = Profiles(ranks=3, steps=3, measured_clocks=False, run_id="abc"), []
    for rank, waits in ((0, 50.0), (1, 2.0)):
        profiles.add(rank, one(rank, waits))
    profiles.finish(said.append, str(tmp_path))
    assert said[0].startswith("--profile: 3 steps after the first, 2 of 3 ranks: " + str(tmp_path))
    assert said[1] == "--profile: no trace from rank 2"
    assert said[2].startswith("  rank 0: working 50%, communicating 50%") and said[3].startswith("  rank 1: working 98%")
    assert said[4] == "  rank 1 is 2.0x slower than the others; they wait 50% of each step for it"
    (run,) = (tmp_path / "taas-profiles").iterdir()
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    assert sorted(os.listdir(run / "ranks")) == ["rank0.json", "rank1.json"]
    assert all(stat.S_IMODE(path.stat().st_mode) == 0o600 for path in [run / "trace.json", *(run / "ranks").iterdir()])


def test_save_lands_whole_files(tmp_path):
    trace = _trace(0, 0, [_x("a", 0.0, 1.0)])
    path = save(merge([trace], False), [trace], str(tmp_path), "r")
    assert json.loads(Path(path).read_text())["traceEvents"] and not list(tmp_path.glob("**/*.partial"))


def test_a_trace_that_cannot_be_read_costs_the_profile_not_the_run(tmp_path):
    profiles, said = Profiles(ranks=1, steps=3, measured_clocks=False, run_id="bad"), []
    profiles.add(0, ProfileTrace(b"not gzip", "here", 0, 0, 4, False, rank_time(0, []), 0))
    profiles.finish(said.append, str(tmp_path))
    assert said == ["--profile: could not merge the ranks' traces: BadGzipFile: Not a gzipped file (b'no')"]
    Profiles(ranks=2, steps=3, measured_clocks=False, run_id="none").finish(said.append, str(tmp_path))
    assert said[-1] == "--profile: no rank sent its trace (a cell that fails or is stopped is not profiled)"
