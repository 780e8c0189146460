"""The run log (output/runlog.py) and the screen a live view keeps (output/liveview.py)."""

import json
import os
import stat
import time
from pathlib import Path

from taas_magic.output.liveview import Screen
from taas_magic.output.relay import Display
from taas_magic.output.runlog import RunLog, prune_logs


def _lines(log: RunLog) -> list[dict]:
    return [json.loads(line) for line in Path(log.path).read_text().splitlines()]


def test_every_entry_is_numbered_kept_on_disk_owner_only_and_the_end_closes_it(tmp_path):
    log = RunLog("abc", directory=str(tmp_path))
    log.header("taas: 2 rank(s)")
    log.out("stdout", "tick 0\n")
    log.publish(Display({"image/svg+xml": "<svg>" + "x" * 5000 + "</svg>", "text/plain": "chart"}, {},
                        {"display_id": "taas-chart-1"}, False))
    log.points([(0, {"loss": 1.0})])
    log.say("taas: a restart", "stderr")
    log.end("failed", ("RankFailed: rank 1 ...",))
    log.out("stdout", "after the end: kept in the kernel, not on the closed file\n")
    assert stat.S_IMODE(os.stat(log.path).st_mode) == 0o600
    rows = _lines(log)
    assert [row["seq"] for row in rows] == list(range(6))
    assert [row["kind"] for row in rows] == ["header", "out", "display", "points", "say", "end"]
    assert rows[2]["data"]["image/svg+xml"] == "<svg: 5011 characters>"  # its points are logged, not its drawing
    assert rows[3]["reports"] == [[0, {"loss": 1.0}]] and rows[5]["lines"] == ["RankFailed: rank 1 ..."]
    first, after = log.since(3)
    assert first == 0 and [entry.seq for entry in after] == [4, 5, 6]
    assert log.displays()[0].display_id == "taas-chart-1" and log.last_line == "after the end: kept in the kernel, not on the closed file"


def test_the_kernel_keeps_a_bounded_tail_and_says_where_the_rest_is(tmp_path):
    log = RunLog("big", keep_bytes=64 << 10, directory=str(tmp_path))
    for i in range(20_000):
        log.out("stdout", f"line {i}\n")
    assert log.kept_bytes <= 64 << 10
    first, entries = log.since(-1)
    assert first > 0 and entries[0].seq == first and entries[-1].seq == 19_999  # the older ones: only on disk
    assert len(_lines(log)) == 20_000
    log.close()


def test_a_waiting_reader_wakes_when_an_entry_arrives(tmp_path):
    log = RunLog("wait", directory=str(tmp_path))
    assert not log.wait(-1, 0.01)
    woken = []
    stop = log.listen(lambda: woken.append(1))
    log.out("stdout", "x")
    stop()
    log.out("stdout", "y")
    assert log.wait(-1, 0.01) and woken == [1]
    log.close()


def test_the_screen_redraws_a_carriage_return_line_in_place_and_keeps_the_last_lines():
    screen = Screen(keep=3)
    screen.feed("epoch 1 [ 10/100]\repoch 1 [ 50/")
    screen.feed("100]\repoch 1 [100/100]\nsaved\r")
    screen.feed("\nnext\n")
    assert screen.shown() == ["epoch 1 [100/100]", "saved", "next"]
    screen.feed("a\nb\nc")
    assert screen.shown() == ["next", "a", "b", "c"]  # three whole lines kept, and the line being written


def test_a_forgotten_log_keeps_only_its_end_in_the_kernel_and_everything_on_disk(tmp_path):
    log = RunLog("run4", directory=str(tmp_path))
    for index in range(100):
        log.out("stdout", f"line {index}\n")
    log.forget()  # a run still going is not forgotten
    assert len(log.since(-1)[1]) == 100
    log.end("ok")
    log.forget()
    first, entries = log.since(-1)
    assert [entry.kind for entry in entries] == ["end"] and first == 100 and log.kept_bytes < 200
    assert len(Path(log.path).read_text().splitlines()) == 101


def test_the_log_folder_keeps_the_newest_files_and_none_older_than_the_rule(tmp_path):
    now = time.time()
    for index in range(6):
        path = tmp_path / f"run{index}.run.jsonl"
        path.write_text("{}\n")
        os.utime(path, (now - index * 60, now - index * 60))  # run0 newest
    old = tmp_path / "old.log"
    old.write_text("x")
    os.utime(old, (now - 31 * 86400, now - 31 * 86400))
    other = tmp_path / "notes.txt"  # not a log: never touched
    other.write_text("mine")
    os.utime(other, (now - 99 * 86400, now - 99 * 86400))
    removed = prune_logs(str(tmp_path), days=30, most=4)
    assert sorted(Path(path).name for path in removed) == ["old.log", "run4.run.jsonl", "run5.run.jsonl"]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "notes.txt", "run0.run.jsonl", "run1.run.jsonl", "run2.run.jsonl", "run3.run.jsonl"]
