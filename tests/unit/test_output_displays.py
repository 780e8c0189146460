"""A rank's displays held until its text reaches them (output/displays.py), with a real OutputRelay fed
the rank's bytes and markers as the supervisor feeds it; the cell is one recorder keeping the order of
text and displays. Pinned down: a display is shown after the text its rank printed before it and before
what it printed after; only for the ranks the relay shows; the ones whose marker never came (or came
before the frame) shown last, ordered by peer then number; and a restart forgets the ranks'
held displays but not the data workers'."""

from taas_magic.output.displays import HeldDisplays
from taas_magic.output.relay import ClearOutput, Display, OutputRelay, display_marker
from taas_magic.peers import RANK, WORKER, Peer, PeerIds
from tests.unit.recording import RecordedCell

RANK_0, RANK_1, WORKER_0 = Peer(RANK, 0), Peer(RANK, 1), Peer(WORKER, 0)


def _display(number: int, text: str = "plot") -> Display:
    return Display({"text/plain": text}, {}, {}, False, number)


def _setup(mode: str = "rank0", ranks: int = 2, workers: int = 0):
    """A relay that writes only when flushed (as a busy run's does) and the displays it places."""
    cell = RecordedCell()
    ids = PeerIds(ranks, workers)
    held: list[HeldDisplays] = []
    relay = OutputRelay(mode, ids, cell.streams, flush_interval=3600, on_marker=lambda peer, n: held[0].show(peer, n))
    held.append(HeldDisplays(relay, cell.publish, ids))
    return cell, relay, held[0]


def test_a_display_is_shown_between_the_text_printed_before_and_after_it():
    cell, relay, held = _setup()
    plot = _display(0)
    held.keep(RANK_0, plot)  # the frame came before its marker
    assert held.has(RANK_0, 0)
    relay.feed(RANK_0, "stdout", b"before\n" + display_marker(0) + b"after\n")
    relay.flush(force=True)
    assert cell.got == [("stdout", "before\n"), ("display", plot), ("stdout", "after\n")]
    assert not held.has(RANK_0, 0)  # shown once


def test_a_marker_reached_before_its_frame_shows_nothing_and_the_frame_is_shown_at_the_end():
    cell, relay, held = _setup()
    relay.feed(RANK_0, "stdout", b"before\n" + display_marker(4))  # nothing held for it yet
    assert cell.got == [] and held.held == {}
    held.keep(RANK_0, _display(4))
    relay.feed(RANK_0, "stdout", b"after\n")
    held.show_leftovers()
    assert cell.got == [("stdout", "before\nafter\n"), ("display", _display(4))]


def test_the_displays_of_a_rank_the_relay_does_not_show_are_dropped():
    cell, relay, held = _setup(mode="rank0")
    held.keep(RANK_1, _display(0))
    relay.feed(RANK_1, "stdout", b"rank 1 text\n" + display_marker(0))
    relay.flush(force=True)
    held.show_leftovers()
    assert cell.got == [] and not held.has(RANK_1, 0)


def test_with_output_all_every_ranks_display_is_shown_after_its_whole_lines():
    cell, relay, held = _setup(mode="all")
    clear = ClearOutput(wait=True, number=0)
    held.keep(RANK_1, clear)
    relay.feed(RANK_1, "stdout", b"tick\n" + display_marker(0))
    assert cell.got == [("stdout", "[rank 1] tick\n"), ("display", clear)]


def test_showing_a_number_never_held_does_nothing():
    cell, relay, held = _setup()
    relay.feed(RANK_0, "stdout", b"text\n")
    held.show(RANK_0, 9)
    assert cell.got == []  # not even the pending text was flushed for it


def test_displays_whose_marker_never_came_are_shown_last_by_peer_then_number():
    cell, relay, held = _setup(mode="all", ranks=2, workers=1)
    frames = {(WORKER_0, 0): _display(0, "worker"), (RANK_1, 2): _display(2, "r1 second"),
              (RANK_0, 5): _display(5, "r0"), (RANK_1, 1): _display(1, "r1 first")}
    for (peer, _), frame in frames.items():
        held.keep(peer, frame)
    relay.feed(RANK_0, "stdout", b"last words\n")  # pending: flushed before the first leftover
    held.show_leftovers()
    assert cell.got == [("stdout", "[rank 0] last words\n"), ("display", frames[(RANK_0, 5)]),
                        ("display", frames[(RANK_1, 1)]), ("display", frames[(RANK_1, 2)]),
                        ("display", frames[(WORKER_0, 0)])]
    assert held.held == {}
    held.show_leftovers()
    assert len(cell.got) == 5


def test_a_restart_forgets_the_ranks_held_displays_and_keeps_the_workers():
    cell, relay, held = _setup(mode="all", ranks=2, workers=1)
    held.keep(RANK_0, _display(0))
    held.keep(RANK_1, _display(0))
    held.keep(WORKER_0, _display(0, "worker"))
    held.forget_ranks()
    assert not held.has(RANK_0, 0) and not held.has(RANK_1, 0) and held.has(WORKER_0, 0)
    held.show_leftovers()
    assert cell.got == [("display", _display(0, "worker"))]
