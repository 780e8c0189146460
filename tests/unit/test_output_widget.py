"""The run's live widget (output/widget.py), a real anywidget model over a real RunLog on disk. No page can
run here, so the comm stands in for one: ``comm.create_comm`` (the hook the comm package provides for a
kernel to replace) makes a comm that records the widget protocol's messages (comm_open's state, ``update``
and ``custom`` messages) and delivers a page's ``{"backlog": seq}`` as a comm message, as a front end would.

Pinned down: a view gets every entry's number but text only for what its screen can still show; new entries
go as one message; the snapshot a reloaded page starts from (lines, partial line, seq) is refreshed at most
every SNAPSHOT_SECONDS and always at the run's end, and the snapshot plus the backlog after its seq rebuild
the screen exactly; the status lines, chart and header come from the log's own displays; a run that failed
says where its error is, never the error itself; a backlog names what is only on disk."""

from pathlib import Path

import comm
import pytest
from comm.base_comm import BaseComm

from taas_magic.output import widget
from taas_magic.output.liveview import Screen
from taas_magic.output.relay import Display
from taas_magic.output.runlog import RunLog
from taas_magic.output.widget import LiveView, shown_entries


class PageComm(BaseComm):
    """A widget's comm as the page sees it: every message the kernel sends, in order."""

    def __init__(self, *args, **kwargs):
        self.sent: list[tuple[str, dict]] = []
        super().__init__(*args, **kwargs)

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        self.sent.append((msg_type, data or {}))

    def from_page(self, content: dict) -> None:
        """A view's custom message, as the page's widget manager sends it."""
        self.handle_msg({"content": {"comm_id": self.comm_id, "data": {"method": "custom", "content": content}},
                         "buffers": []})

    def custom(self) -> list[dict]:
        return [data["content"] for kind, data in self.sent if kind == "comm_msg" and data.get("method") == "custom"]

    def updates(self) -> list[dict]:
        return [data["state"] for kind, data in self.sent if kind == "comm_msg" and data.get("method") == "update"]


@pytest.fixture
def page(monkeypatch):
    """The comms the widgets made, each as the page sees it."""
    made: list[PageComm] = []

    def create_comm(*args, **kwargs):
        made.append(PageComm(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(comm, "create_comm", create_comm)
    return made


@pytest.fixture
def log(tmp_path):
    log = RunLog("run9", directory=str(tmp_path))
    yield log
    log.close()


@pytest.fixture
def view(log, page):
    log.header("taas: 2 ranks on cpu")
    view = LiveView(log)
    yield view
    view.close()


def _comm(page: list[PageComm]) -> PageComm:
    """The live view's comm (the model's layout has one of its own)."""
    (found,) = [c for c in page if c.sent and "run_id" in c.sent[0][1].get("state", {})]
    return found


def _new(log: RunLog, since: int) -> list:
    return log.since(since)[1]


def test_a_flood_sends_every_entrys_number_and_only_the_text_a_screen_still_shows(log):
    for i in range(1000):
        log.out("stdout", f"line {i}\n")
    entries = _new(log, -1)
    shown = shown_entries(entries, keep=10)
    assert [seq for seq, _, _ in shown] == list(range(1000))
    with_text = [text for _, _, text in shown if text]
    assert 10 <= len(with_text) <= 11  # the last lines, the entry that ends where the screen begins at most
    full, sent = Screen(10), Screen(10)
    for entry in entries:
        full.feed(entry.text)
    for _, _, text in shown:
        sent.feed(text)
    assert sent.shown() == full.shown() == [f"line {i}" for i in range(990, 1000)]


def test_entries_are_sent_as_a_screen_shows_them(log):
    plot = Display({"text/plain": "<Figure>"}, {}, {}, False)
    chart = Display({"image/svg+xml": "<svg/>", "text/plain": "chart"}, {}, {"display_id": "taas-chart-1"}, False)
    log.out("stderr", "warn\n")
    log.say("taas: rank 1 restarted")
    log.publish(plot)
    log.publish(chart)
    log.points([(0, {"loss": 1.0})])
    assert shown_entries(_new(log, -1)) == [[0, "stderr", "warn\n"], [1, "say", "taas: rank 1 restarted\n"],
                                            [2, "stdout", "[display] <Figure>\n"], [3, "none", ""], [4, "none", ""]]


def test_a_new_view_carries_the_run_its_module_and_a_running_state(view, log, page):
    state = _comm(page).sent[0][1]["state"]
    assert (state["run_id"], state["header"], state["log_path"]) == ("run9", "taas: 2 ranks on cpu", log.path)
    assert (state["state"], state["seq"], state["lines"], state["error"]) == ("running", -1, [], [])
    assert state["_esm"] == Path(widget.__file__).with_name("liveview.js").read_text()  # its page half, in the model


def test_new_entries_go_as_one_message_and_the_snapshot_is_refreshed_at_most_every_interval(view, log, page,
                                                                                          monkeypatch):
    page_comm = _comm(page)
    log.out("stdout", "epoch 1\nepoch 2 [10%]\repoch 2 [50%]")
    view.push(_new(log, 0))  # the first push: a snapshot at once
    monkeypatch.setattr(widget, "SNAPSHOT_SECONDS", 3600.0)  # from now on, every push is within the interval
    assert page_comm.custom() == [{"entries": [[1, "stdout", "epoch 1\nepoch 2 [10%]\repoch 2 [50%]"]]}]
    assert (view.lines, view.partial, view.seq) == (["epoch 1"], "epoch 2 [50%]", 1)
    assert page_comm.updates()[-1] == {"seq": 1, "partial": "epoch 2 [50%]", "lines": ["epoch 1"]}  # one update
    log.out("stdout", "\repoch 2 [100%]\n")
    log.out("stdout", "epoch 3\n")
    updates = len(page_comm.updates())
    view.push(_new(log, 1))
    assert page_comm.custom()[-1] == {"entries": [[2, "stdout", "\repoch 2 [100%]\n"], [3, "stdout", "epoch 3\n"]]}
    assert view.seq == 1 and len(page_comm.updates()) == updates  # within the interval: the snapshot waits
    log.end("ok")
    view.push(_new(log, 3))  # the run's last entry: a snapshot whatever the time
    assert (view.lines, view.partial, view.seq, view.state) == (["epoch 1", "epoch 2 [100%]", "epoch 3"], "", 4, "ok")
    assert view.error == []


def test_a_reloaded_page_rebuilds_the_screen_from_the_snapshot_and_the_backlog_after_it(view, log, page, monkeypatch):
    log.out("stdout", "a\nb\n")
    view.push(_new(log, 0))  # snapshot as of entry 1
    monkeypatch.setattr(widget, "SNAPSHOT_SECONDS", 3600.0)
    log.out("stdout", "c\nd")
    log.out("stdout", "\re\n")
    view.push(_new(log, 1))  # no snapshot: within the interval
    page_comm = _comm(page)
    page_comm.from_page({"backlog": view.seq})  # what a restored view asks
    reply = page_comm.custom()[-1]
    assert reply == {"backlog": True, "entries": [[2, "stdout", "c\nd"], [3, "stdout", "\re\n"]]}
    screen = Screen()
    screen.lines.extend(view.lines)
    screen.partial = view.partial
    for _, _, text in reply["entries"]:
        screen.feed(text)
    assert screen.shown() == ["a", "b", "c", "e"]  # what the page showed before the reload


def test_a_backlog_names_the_entries_only_on_disk_and_odd_messages_are_ignored(tmp_path, page):
    log = RunLog("big", keep_bytes=4096, directory=str(tmp_path))
    view = LiveView(log)
    try:
        for i in range(200):
            log.out("stdout", f"{i}\n")
        first, _ = log.since(-1)
        page_comm = _comm(page)
        page_comm.from_page({"backlog": 5})
        reply = page_comm.custom()[-1]
        assert reply["skipped"] == [6, first - 1] and reply["entries"][0][0] == first
        assert reply["entries"][-1] == [199, "stdout", "199\n"]
        sent = len(page_comm.sent)
        for odd in ({"backlog": "5"}, {"backlog": None}, {"other": 1}):
            page_comm.from_page(odd)
        assert len(page_comm.sent) == sent
        page_comm.from_page({"backlog": 198})  # a view that has everything but the last
        assert page_comm.custom()[-1] == {"backlog": True, "entries": [[199, "stdout", "199\n"]]}
    finally:
        view.close()
        log.close()


def test_the_status_lines_chart_and_header_come_from_the_logs_own_displays(view, log, page):
    log.publish(Display({"text/plain": "health: cpu 80%"}, {}, {"display_id": "taas-health-1"}, False))
    log.publish(Display({"text/plain": "taas data: 4/8"}, {}, {"display_id": "taas-data-1"}, False))
    log.publish(Display({"image/svg+xml": "<svg>1</svg>", "text/plain": "c"}, {}, {"display_id": "taas-chart-1"}, False))
    log.publish(Display({"text/plain": "a rank's own"}, {}, {"display_id": "mine"}, False))
    log.publish(Display({"text/plain": "taas data: 8/8"}, {}, {"display_id": "taas-data-1"}, True))  # updated in place
    log.header("taas: 2 ranks on cpu, attempt 2")
    view.push(_new(log, 0))
    assert view.status == {"taas-health-1": "health: cpu 80%", "taas-data-1": "taas data: 8/8"}
    assert view.chart == "<svg>1</svg>" and view.header == "taas: 2 ranks on cpu, attempt 2"
    assert any(state.get("status") == view.status for state in _comm(page).updates())  # the page got it


def test_a_failed_run_says_where_its_error_is_never_the_error_itself(view, log, page):
    log.out("stderr", "Traceback (most recent call last):\n")
    log.end("failed", ("RankFailed: rank 1 raised ZeroDivisionError: division by zero",))
    view.push(_new(log, 0))
    assert view.state == "failed"
    assert view.error == ["taas: the run failed; its error is in the cell's output (below this view, or where "
                          "%taas wait run9 ran)"]
    assert "ZeroDivisionError" not in repr(_comm(page).sent)
