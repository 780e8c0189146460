import io

from taas_magic.output.relay import OutputRelay, display_marker
from taas_magic.peers import RANK, Peer, PeerIds

RANK_0, RANK_1 = Peer(RANK, 0), Peer(RANK, 1)


def _relay(mode="rank0", ranks=2):
    out, err = io.StringIO(), io.StringIO()
    return OutputRelay(mode, PeerIds(ranks), {"stdout": out, "stderr": err}, flush_interval=0.0), out, err


def test_rank0_passes_through_with_carriage_returns_and_split_utf8():
    relay, out, _ = _relay()
    snow = "❄".encode()
    relay.feed(RANK_0, "stdout", b"10%\r20%\r" + snow[:1])
    relay.feed(RANK_0, "stdout", snow[1:] + b"\n")
    relay.feed(RANK_1, "stdout", b"rank one is silent\n")
    relay.flush(force=True)
    assert out.getvalue() == "10%\r20%\r❄\n"


def test_all_mode_prefixes_whole_lines_only():
    relay, out, _ = _relay("all")
    relay.feed(RANK_0, "stdout", b"a\nb")
    relay.feed(RANK_1, "stdout", b"c\n")
    relay.feed(RANK_0, "stdout", b"b\n")
    relay.end_of_stream(RANK_1, "stdout")
    relay.flush(force=True)
    assert out.getvalue() == "[rank 0] a\n[rank 1] c\n[rank 0] bb\n"


def test_last_lines_show_what_a_terminal_shows():
    relay, _, _ = _relay()
    relay.feed(RANK_1, "stderr", b"line 1\nprogress 10%\rprogress 90%\nTraceback: boom")
    assert relay.last_lines(RANK_1) == ("line 1", "progress 90%", "Traceback: boom")


def test_coalescing_bounds_writes():
    out = io.StringIO()
    writes = []
    out.write = lambda text, _w=out.write: (writes.append(text), _w(text))[1]  # type: ignore[method-assign]
    relay = OutputRelay("rank0", PeerIds(1), {"stdout": out, "stderr": io.StringIO()}, flush_interval=3600)
    relay.feed(RANK_0, "stdout", b"first\n")
    relay.flush(force=True)
    for i in range(1000):
        relay.feed(RANK_0, "stdout", f"{i}\n".encode())
        relay.flush()  # within the interval: gathered, not written
    relay.flush(force=True)
    assert len(writes) == 2
    assert out.getvalue() == "first\n" + "".join(f"{i}\n" for i in range(1000))


def test_display_markers_are_cut_out_in_place_even_when_split():
    events = []
    out = io.StringIO()
    relay = OutputRelay("rank0", PeerIds(1), {"stdout": out, "stderr": io.StringIO()}, flush_interval=0.0,
                        on_marker=lambda rank, n: events.append((out.getvalue() + "".join(relay.pending["stdout"]), n)))
    data = b"before\n" + display_marker(0) + b"after\n" + display_marker(1)
    for i in range(len(data)):  # one byte at a time: markers split everywhere
        relay.feed(RANK_0, "stdout", data[i : i + 1])
    relay.flush(force=True)
    assert events == [("before\n", 0), ("before\nafter\n", 1)]
    assert out.getvalue() == "before\nafter\n"
    assert relay.last_lines(RANK_0) == ("before", "after")


def test_mute_drops_noise_after_a_failure():
    relay, out, _ = _relay()
    relay.feed(RANK_0, "stdout", b"before\n")
    relay.flush(force=True)
    relay.mute()
    relay.feed(RANK_0, "stdout", b"KeyboardInterrupt\n")
    relay.flush(force=True)
    assert out.getvalue() == "before\n"


def test_a_kept_ranks_cell_end_is_cut_out_of_each_stream_even_when_split_and_noted():
    from taas_magic.output.relay import CELL_END

    relay, out, err = _relay()
    for stream, text in (("stdout", "last line\n" + CELL_END), ("stderr", "warning\n" + CELL_END)):
        data = text.encode()
        for i in range(len(data)):  # one byte at a time: the end split everywhere
            relay.feed(RANK_0, stream, data[i : i + 1])
            assert relay.cell_ended(RANK_0) is False or (stream == "stderr" and i == len(data) - 1)
    relay.flush(force=True)
    assert out.getvalue() == "last line\n" and err.getvalue() == "warning\n"
    assert relay.cell_ended(RANK_0)
