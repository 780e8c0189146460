"""A large closure travels as one shared file whose digest the authenticated frame carries."""

import os
import pickle

import pytest

from taas_magic import wire
from taas_magic.handoff import ClosureHandoff, receive_closure


class _Frames:
    """The rank's channel, reduced to the frame it is about to receive."""

    def __init__(self, body: bytes):
        self._frame = wire.decode_body(body)

    def recv(self):
        return self._frame


def test_small_closures_travel_in_the_frame():
    handoff = ClosureHandoff(pickle.dumps({"x": 1}), "run", threshold=1 << 20)
    assert handoff.path is None
    assert pickle.load(receive_closure(_Frames(handoff.body))) == {"x": 1}


def test_large_closures_are_one_owner_only_file_checked_against_the_digest():
    blob = pickle.dumps({"data": bytes(range(256)) * 4096})
    handoff = ClosureHandoff(blob, "run", threshold=1024)
    try:
        assert handoff.path and oct(os.stat(handoff.path).st_mode & 0o777) == "0o600"
        assert pickle.load(receive_closure(_Frames(handoff.body)))["data"][:3] == b"\x00\x01\x02"
        with open(handoff.path, "r+b") as handle:  # someone changes the file after the kernel wrote it
            handle.seek(len(blob) // 2)
            handle.write(b"\xff")
        with pytest.raises(wire.AuthenticationError, match="does not match the digest"):
            receive_closure(_Frames(handoff.body))
    finally:
        handoff.remove()
    assert not os.path.exists(handoff.path or "/nonexistent")
