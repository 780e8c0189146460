"""A run's log shown as the cell's own output (output/cellstream.py), from a real RunLog on disk through a real
OutputBudget; the cell's streams and display publisher are one recorder that keeps the order in which the
cell received text and displays (IPython's cannot run here). Pinned down: each entry once and in order, rank
text through the budget with its notice and last lines at the end, taas's own lines whole, what only the log
keeps (chart points, a pdb session) left out, a gap of entries only on disk named with the file, and, with a
live widget showing the rest, only the ranks' own displays."""

import pytest

from taas_magic.output.budget import OutputBudget
from taas_magic.output.cellstream import CellStream
from taas_magic.output.relay import ClearOutput, Display
from taas_magic.output.runlog import RunLog
from tests.unit.recording import RecordedCell


@pytest.fixture
def log(tmp_path, monkeypatch):
    monkeypatch.setenv("TAAS_LOG_DIR", str(tmp_path / "logs"))
    log = RunLog("run1", directory=str(tmp_path / "logs"))
    yield log
    log.close()


def _display(display_id: str | None, text: str = "x") -> Display:
    return Display({"text/plain": text}, {}, {"display_id": display_id} if display_id else {}, False)


def test_each_entry_is_shown_once_in_the_order_the_run_showed_it(log):
    cell = RecordedCell()
    stream = CellStream(log, cell.streams, cell.publish, budget=None)
    assert stream.show_new() is False  # nothing yet
    mine = _display(None, "a rank's plot")
    log.header("taas: 2 ranks on cpu")
    log.out("stdout", "epoch 1 [10%]\repoch 1 [100%]\n")
    log.publish(mine)
    log.out("stderr", "a warning\n")
    log.say("taas: rank 1 restarted", "stderr")
    log.points([(0, {"loss": 1.0})])  # the chart's points: the log's, not the cell's
    log.debugger("(Pdb rank 1) p x\n")  # the console cell showed it itself
    assert stream.show_new() is True
    assert cell.got == [("stdout", "taas: 2 ranks on cpu\n"), ("stdout", "epoch 1 [10%]\repoch 1 [100%]\n"),
                        ("display", mine), ("stderr", "a warning\n"), ("stderr", "taas: rank 1 restarted\n")]
    assert stream.show_new() is False and len(cell.got) == 5  # shown once
    cleared = ClearOutput(wait=True)
    log.publish(cleared)
    log.out("stdout", "after\n")
    log.end("ok")
    assert stream.show_new() is True
    assert cell.got[5:] == [("display", cleared), ("stdout", "after\n")]  # the end itself shows nothing here
    assert stream.seq == log.next_seq - 1


def test_rank_text_goes_through_the_budget_and_the_end_gives_its_notice_and_last_lines(log, tmp_path):
    cell = RecordedCell()
    budget = OutputBudget("run1", head_lines=3, tail_lines=2)
    stream = CellStream(log, cell.streams, cell.publish, budget)
    for i in range(10):
        log.out("stdout", f"line {i}\n")
    log.say("taas: a restart")  # taas's own lines are not the ranks' text: never elided
    stream.show_new()
    assert cell.text() == "line 0\nline 1\nline 2\ntaas: a restart\n"
    writes = len(cell.got)
    log.end("ok")
    stream.show_new()
    stream.finish()
    path = tmp_path / "logs" / "run1.log"
    assert cell.got[writes:] == [("stdout", f"\n[taas] 5 lines elided, full log at {path}\nline 8\nline 9\n")]  # one write
    assert path.read_text() == "".join(f"line {i}\n" for i in range(10))


def test_the_last_lines_of_two_streams_are_written_one_run_of_lines_at_a_time(log):
    cell = RecordedCell()
    stream = CellStream(log, cell.streams, cell.publish, OutputBudget("run1", head_lines=1, tail_lines=4))
    log.out("stdout", "head\n")
    for text, name in [("a\n", "stdout"), ("b\n", "stdout"), ("c\n", "stderr"), ("d\n", "stdout")]:
        log.out(name, text)
    stream.show_new()
    del cell.got[:]
    stream.finish()
    assert cell.got == [("stdout", "a\nb\n"), ("stderr", "c\n"), ("stdout", "d\n")]


def test_without_a_budget_nothing_is_elided_and_finish_adds_nothing(log):
    cell = RecordedCell()
    stream = CellStream(log, cell.streams, cell.publish, budget=None)
    for i in range(50):
        log.out("stdout", f"{i}\n")
    stream.show_new()
    stream.finish()
    assert cell.text() == "".join(f"{i}\n" for i in range(50)) and cell.text("stderr") == ""


def test_entries_no_longer_kept_in_the_kernel_are_named_with_the_file_that_has_them(tmp_path):
    log = RunLog("small", keep_bytes=2048, directory=str(tmp_path))
    try:
        cell = RecordedCell()
        stream = CellStream(log, cell.streams, cell.publish, budget=None)
        for i in range(100):
            log.out("stdout", f"{i:03}\n")
        first, _ = log.since(-1)
        assert first > 0
        stream.show_new()
        assert cell.got[0] == ("stderr", f"[taas] entries 0..{first - 1} are in {log.path}\n")
        assert cell.text() == "".join(f"{i:03}\n" for i in range(first, 100))
    finally:
        log.close()


def test_with_a_live_widget_only_the_ranks_own_displays_reach_the_cell(log):
    cell = RecordedCell()
    stream = CellStream(log, cell.streams, cell.publish, OutputBudget("run1", head_lines=1), displays_only=True)
    rank_plot, chart, data_line = _display(None, "plot"), _display("taas-chart-1"), _display("taas-data-ab12cd34")
    log.header("taas: 2 ranks")
    log.out("stdout", "one\ntwo\nthree\n")
    for message in (rank_plot, chart, data_line):
        log.publish(message)
    log.say("taas: a restart")
    stream.show_new()
    assert cell.got == [("display", rank_plot)]
    stream.say("taas: the run went on in the background")  # the kernel's own line: shown even so
    log.end("ok")
    stream.show_new()
    stream.finish()  # the widget shows the text: no notice, no last lines
    assert cell.got == [("display", rank_plot), ("stdout", "taas: the run went on in the background\n")]


def test_a_kernel_line_takes_its_place_among_the_entries_shown(log):
    cell = RecordedCell()
    stream = CellStream(log, cell.streams, cell.publish, budget=None)
    log.out("stdout", "before\n")
    stream.show_new()
    stream.say("taas: detached")
    log.out("stdout", "after\n")
    stream.show_new()
    assert cell.text() == "before\ntaas: detached\nafter\n"
