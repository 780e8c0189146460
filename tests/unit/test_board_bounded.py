"""output/board.py in bounded memory: a million reports through a real Board (built as
kernel/runs/execution.py builds it) hold a few MB in the kernel, the chart still starts at the first
report and ends at the last, taas.metrics() ends with the last 10,000 reports exactly; the band
still lines the ranks' reports up when they have thinned differently; the run log keeps every
report on disk while the kernel keeps a bounded tail of them."""

import json
import re
import time
import tracemalloc

import pytest

from taas_magic.history import PAST, RECENT
from taas_magic.output.board import Board
from taas_magic.output.reports import Report
from taas_magic.output.runlog import RunLog

pytestmark = pytest.mark.unpinned  # pure Python: nothing of the minimums' pins (.ci/run)

MILLION, BATCH = 1_000_000, 2000  # a rank reporting 8,000 steps a second sends 2,000 a batch


class Displays:
    """publish as the run log keeps displays: the newest of each display id."""

    def __init__(self):
        self.newest = {}

    def __call__(self, message):
        self.newest[message.transient["display_id"]] = message


class Points:
    """points as the run log takes them (it writes them to disk): here, only counted."""

    def __init__(self):
        self.count = 0

    def __call__(self, reports):
        self.count += len(reports)


LAST = MILLION - 1  # the loss, 1.0 - step / LAST: from 1.0 (the first report) down to 0.0 (the last)


def _polyline(svg: str) -> list[tuple[float, float]]:
    points = re.search(r'<polyline points="([^"]*)"', svg).group(1)
    return [tuple(map(float, point.split(","))) for point in points.split()]


def test_a_million_reports_hold_a_few_mb_and_keep_the_first_the_last_and_the_last_10000():
    displays, logged = Displays(), Points()
    board = Board(2, displays, logged)  # as kernel/runs/execution.py: Board(ranks, log.publish, points)
    board.start()
    started = time.process_time()  # CPU seconds (every thread's): what the keeping costs, however busy the machine
    tracemalloc.start()
    try:
        for start in range(0, MILLION, BATCH):
            reports = [(step, {"loss": 1.0 - step / LAST}) for step in range(start, start + BATCH)]
            health = {"at": time.monotonic(), "cpu": time.process_time()} if start % (8 * BATCH) == 0 else None
            for rank in (0, 1):  # rank 1 sends the same batch (its own objects need not cost the test's time)
                board.add(rank, Report(time.monotonic(), reports, health))
            if start % (MILLION // 4) == 0:
                board.show(force=True)  # (the supervisor calls it at each poll: it draws at most twice a second)
            del reports
        board.show(force=True)
        retained, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    seconds = time.process_time() - started
    # (a) the kernel's side: what the board keeps (and its displays), however long the run
    print(f"a million reports on two ranks: {retained / 2**20:.1f} MiB kept, {peak / 2**20:.1f} MiB at the peak, "
          f"{seconds:.1f} s of CPU")
    assert retained < 16 << 20 and peak < 24 << 20, (retained >> 20, peak >> 20)
    assert logged.count == MILLION  # every report went on to the run log
    # (b) the chart: rank 0's line from the true first report (x at the left, loss 1.0 at the top)
    # to the true last (x at the right, loss 0.0 at the bottom); the axis from step 0 to the last step
    chart = displays.newest[board.chart_id].data
    line = _polyline(chart["image/svg+xml"])
    assert line[0] == (46.0, 18.0) and line[-1] == (550.0, 128.0) and len(line) <= 1000
    assert ">0</text>" in chart["image/svg+xml"] and f">{MILLION - 1}</text>" in chart["image/svg+xml"]
    assert "rank 0: 0 (band: every rank's min-max)" in chart["image/svg+xml"]
    assert chart["text/plain"] == "taas chart · step 1e+06, loss 0"  # as .4g writes them
    # (c) taas.metrics(): the first report, an evenly thinned past, the last 10,000 exactly
    reports = board.metrics()
    assert len(reports) <= RECENT + PAST and reports[0] == {"step": 0, "loss": 1.0}
    assert reports[-RECENT:] == [{"step": step, "loss": 1.0 - step / LAST} for step in range(MILLION - RECENT, MILLION)]
    past = [report["step"] for report in reports[:-RECENT]]
    assert len({after - before for before, after in zip(past, past[1:])}) == 1 and len(past) >= PAST // 2
    # the health line: each rank's last batches only
    assert all(len(rank.batches) <= 8 for rank in board.health.ranks) and "reports/s" in board.health.line()
    # about 12 s of CPU here (most of it tracemalloc's, on every allocation and free); a quadratic keep would take
    # minutes. CPU time, not wall time: on a 2-core machine beside a CPU burner the same run took 52 s of wall time
    assert seconds < 60, seconds


def test_the_band_lines_up_ranks_that_thinned_differently():
    board = Board(3, Displays())
    counts, batches = (45_000, 61_000, 23_500), (1000, 700, 333)
    for rank, (count, batch) in enumerate(zip(counts, batches)):
        for start in range(0, count, batch):
            board.add(rank, Report(0.0, [(10 * step, {"loss": step * 0.001 + rank})
                                         for step in range(start, min(count, start + batch))], None))
    band = board._band("loss")
    assert band[0] == (0, 0.0, 2.0) and band[-1][0] <= min(counts) - 1 and len(band) > 500
    for index, low, high in band:  # every rank's value at the same report index: rank 0's, rank 2's = rank 0's + 2
        assert low == index * 0.001 and high == index * 0.001 + 2
    steps = board.ranks[0].series["loss"].steps
    assert all(steps.kept(index) for index, _, _ in band)  # drawn at rank 0's own steps
    assert "every rank's min-max" in board.chart()


def test_the_run_log_keeps_every_report_on_disk_and_a_bounded_tail_in_the_kernel(tmp_path):
    log = RunLog("bounded", keep_bytes=1 << 20, directory=str(tmp_path))
    board = Board(1, log.publish, log.points)
    count = 50_000
    tracemalloc.start()
    try:
        for start in range(0, count, 1000):
            board.add(0, Report(0.0, [(step, {"loss": step * 0.5}) for step in range(start, start + 1000)], None))
        retained, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    log.end("ok")
    assert len(board.metrics()) < count
    with open(log.path) as lines:
        on_disk = [step for line in lines for step, _ in json.loads(line).get("reports", [])]
    assert on_disk == list(range(count))
    # the log's kernel tail counts what its reports hold (1 MiB of them), the board its bounded history
    assert retained < 12 << 20, retained >> 20
    assert sum(len(entry.reports) for entry in log.since(-1)[1]) < 4000  # 1 MiB of them (at 32 bytes: 32,000)
