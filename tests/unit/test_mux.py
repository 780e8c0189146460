"""The supervisor's I/O (kernel/supervision/mux.py) with a real listener and channel and a stand-in process
(two pipes and an exit code): greeting then queued frames, output as events, and an exit
reported only after the frames the process sent before it."""

import os
import threading
import time

from taas_magic import protocol, wire
from taas_magic.kernel.supervision.mux import FrameArrived, Mux, Output, OutputEnded, PeerConnected, PeerExited
from taas_magic.kernel.supervision.server import PeerServer
from taas_magic.peers import RANK, Peer, PeerIds
from taas_magic.protocol import Elements, RankError
from taas_magic.transfer.returns import Released

RANK_0 = Peer(RANK, 0)


class _Process:
    """What the mux reads of a rank: its pipes and its exit code (no process is started)."""

    def __init__(self, rank: int):
        self.index, self.host, self.exit_fd, self.code = rank, "localhost", None, None
        self.stdout_fd, self.out = os.pipe()
        self.stderr_fd, self.err = os.pipe()

    def poll(self):
        return self.code


def _until(mux: Mux, done, seconds: float = 60.0) -> list:
    events: list = []
    deadline = time.monotonic() + seconds
    while not done(events):
        assert time.monotonic() < deadline, events
        events += list(mux.events(0.05))
    return events


def test_a_peer_gets_its_greeting_then_what_waited_and_its_exit_comes_after_its_last_frame():
    key = wire.new_key()
    server = PeerServer(key, 1)
    mux = Mux(server, PeerIds(1), greeting=lambda peer: [protocol.encode(Released())])
    process = _Process(0)
    mux.watch(RANK_0, process)
    mux.deliver(RANK_0, protocol.encode(Elements(0, 0, [("seg", 8)])))  # before it connected: it waits
    connected: dict = {}
    thread = threading.Thread(target=lambda: connected.setdefault(
        "channel", protocol.PeerChannel(wire.BlockingChannel.connect(*server.address, key, 0))))
    thread.start()
    try:
        assert PeerConnected(RANK_0) in _until(mux, lambda events: PeerConnected(RANK_0) in events)
        thread.join(60)
        channel = connected["channel"]
        assert channel.receive() == Released() and channel.receive() == Elements(0, 0, [("seg", 8)])
        channel.send(RankError("raised ValueError: x", "Traceback ..."))
        os.write(process.out, b"last words\n")
        for fd in (process.out, process.err):
            os.close(fd)
        process.code = 1  # it died before the kernel read its report
        assert list(mux.exits()) == [FrameArrived(RANK_0, RankError("raised ValueError: x", "Traceback ...")),
                                     PeerExited(RANK_0, 1)]
        assert list(mux.exits()) == []  # an exit is reported once
        ends = {OutputEnded(RANK_0, "stdout"), OutputEnded(RANK_0, "stderr")}
        events = _until(mux, lambda events: ends <= set(events))
        assert [event for event in events if isinstance(event, Output)] == [Output(RANK_0, "stdout", b"last words\n")]
        mux.deliver(RANK_0, protocol.encode(Elements(0, 0, [])))  # it exited: nothing is queued for it
        assert not mux.channels.queued
        assert mux.exited_connected(RANK_0)  # exited, its channel not yet closed: frames may still come
        channel.close()
        _until(mux, lambda events: not mux.exited_connected(RANK_0))  # its channel's end is read too
    finally:
        thread.join(60)
        mux.close()
        server.close()
        for fd in (process.stdout_fd, process.stderr_fd):
            os.close(fd)
