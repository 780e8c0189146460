import pickle
import socket
import threading
import time

import pytest

from taas_magic import wire
from taas_magic.kernel.supervision.server import PeerServer


class _Detonator:
    """Unpickling this writes a file: proof that bytes were (or were not) unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _codecs(key, nonce):
    kernel = wire.FrameCodec(key, nonce, outgoing=wire.KERNEL_TO_RANK, incoming=wire.RANK_TO_KERNEL)
    rank = wire.FrameCodec(key, nonce, outgoing=wire.RANK_TO_KERNEL, incoming=wire.KERNEL_TO_RANK)
    return kernel, rank


def _frame(codec, kind, data):
    body = wire.encode_body(kind, data)
    return codec.header(body) + body


def test_frames_round_trip():
    key, nonce = wire.new_key(), wire.new_nonce()
    kernel, rank = _codecs(key, nonce)
    reader = wire.FrameReader(kernel)
    data = _frame(rank, "result", wire.dumps({"a": 1})) + _frame(rank, "display", b"x")
    frames = []
    for i in range(0, len(data), 7):  # arrives in pieces
        frames += reader.feed(data[i : i + 7])
    assert [(k, bytes(b)) for k, b in frames] == [("result", wire.dumps({"a": 1})), ("display", b"x")]


def test_forged_frame_is_rejected_before_unpickling(tmp_path):
    key, nonce = wire.new_key(), wire.new_nonce()
    kernel, _ = _codecs(key, nonce)
    _, forger = _codecs(wire.new_key(), nonce)  # a peer without the key
    target = tmp_path / "detonated"
    forged = _frame(forger, "result", pickle.dumps(_Detonator(str(target))))
    with pytest.raises(wire.AuthenticationError):
        wire.FrameReader(kernel).feed(forged)
    assert not target.exists()


def test_replayed_and_reflected_frames_are_rejected():
    key, nonce = wire.new_key(), wire.new_nonce()
    kernel, rank = _codecs(key, nonce)
    frame = _frame(rank, "display", b"once")
    reader = wire.FrameReader(kernel)
    reader.feed(frame)
    with pytest.raises(wire.AuthenticationError):
        reader.feed(frame)  # replay on the same connection
    _, other_rank = _codecs(key, wire.new_nonce())
    with pytest.raises(wire.AuthenticationError):  # replay from another connection
        wire.FrameReader(_codecs(key, nonce)[0]).feed(_frame(other_rank, "display", b"x"))
    kernel2, _ = _codecs(key, nonce)
    reflected = _frame(kernel2, "spec", b"x")  # the kernel's own frame sent back to it
    with pytest.raises(wire.AuthenticationError):
        wire.FrameReader(_codecs(key, nonce)[0]).feed(reflected)


def _serve_one(server):
    """Run the server side of one handshake; return the connection or False."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(server.listener, selectors.EVENT_READ)
    sel.select(5)
    peer = server.accept()
    sel.unregister(server.listener)
    sel.register(peer.sock, selectors.EVENT_READ)
    while True:
        sel.select(5)
        outcome = server.read_hello(peer)
        if outcome is not None:
            sel.close()
            if outcome is False:
                server.drop(peer)
            return outcome


def test_unauthenticated_connection_is_dropped():
    server = PeerServer(wire.new_key(), 2)
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("result", _serve_one(server)))
    thread.start()
    attacker = socket.create_connection(server.address)
    nonce = attacker.recv(wire.NONCE_SIZE)
    attacker.sendall(wire.hello_mac(wire.new_key(), nonce, 0) + wire.RANK.pack(0))
    thread.join(60)
    assert outcome["result"] is False
    assert attacker.recv(1) == b""  # the kernel closed it
    assert server.rejected == 1
    attacker.close()
    server.close()


def test_rank_with_key_connects_and_exchanges_frames():
    key = wire.new_key()
    server = PeerServer(key, 2)
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("result", _serve_one(server)))
    thread.start()
    channel = wire.BlockingChannel.connect(*server.address, key, 1)
    thread.join(60)
    connection = outcome["result"]
    assert connection.peer_id == 1
    connection.send(wire.encode_body("spec", wire.dumps({"x": 1})))
    kind, body = channel.recv()
    assert kind == "spec" and wire.loads_verified(body) == {"x": 1}
    channel.send("error", wire.dumps("boom"))
    connection.sock.setblocking(True)
    frames = connection.reader.feed(connection.sock.recv(1 << 16))
    assert frames[0][0] == "error"
    channel.close()
    connection.sock.close()
    server.close()


def test_the_blocking_accept_serves_the_hub_with_the_same_hello():
    """One hello for every listener: the cluster's output hub accepts a peer that proves the key
    for an id it still expects, and closes one that does not (wrong key, repeated id)."""
    key = wire.new_key()
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()[:2]
    taken: set[int] = set()

    def accept_one() -> tuple[socket.socket, int] | None:
        accepted = wire.accept(listener, key, lambda claimed: claimed < 4 and claimed not in taken, timeout=60)
        if accepted is not None:
            taken.add(accepted[1])
        return accepted

    results: list = []
    for attempt_key, channel in ((key, 2), (wire.new_key(), 3), (key, 2)):
        thread = threading.Thread(target=lambda: results.append(accept_one()))
        thread.start()
        sock, _ = wire.connect(address, attempt_key, channel, timeout=60)
        thread.join(60)
        if results[-1] is None:
            assert sock.recv(1) == b""  # the hub closed it, having unpickled nothing
        sock.close()
    assert [result if result is None else result[1] for result in results] == [2, None, None]
    results[0][0].close()
    listener.close()


def test_the_blocking_accept_gives_up_on_a_peer_that_never_says_hello():
    """A connection that sends nothing costs the hub its timeout, once: it is closed, not waited on forever."""
    listener = socket.create_server(("127.0.0.1", 0))
    silent = socket.create_connection(listener.getsockname()[:2])
    started = time.monotonic()
    assert wire.accept(listener, wire.new_key(), lambda claimed: True, timeout=0.3) is None
    assert time.monotonic() - started < 30  # its 0.3 s, not for ever (the rest: a loaded machine's scheduling)
    silent.recv(wire.NONCE_SIZE)
    assert silent.recv(1) == b""  # closed by the hub
    silent.close()
    listener.close()
