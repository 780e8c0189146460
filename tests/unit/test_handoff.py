"""The closure's pickle travels in the frame; its tensor bytes in one owner-only file the ranks map."""

import os

import pytest
import torch

from taas_magic import protocol, wire
from taas_magic.cell.closure import serialise_closure
from taas_magic.transfer.handoff import ClosureHandoff, receive_closure


class _Frames:
    """The rank's channel, reduced to the frame it is about to receive."""

    def __init__(self, body: bytes):
        self._frame = protocol.decode_body(body, protocol.ToPeer)

    def receive(self):
        return self._frame


def _no_feeds(index):
    raise KeyError(index)


def test_small_closures_travel_in_the_frame():
    handoff = ClosureHandoff(serialise_closure({"x": 1, "t": torch.arange(4)}), "run", threshold=1 << 20)
    assert handoff.path is None
    values = receive_closure(_Frames(handoff.body)).load(_no_feeds)
    assert values["x"] == 1 and values["t"].tolist() == [0, 1, 2, 3]


def test_large_closures_map_one_owner_only_file_checked_against_the_digest():
    big = torch.arange(1 << 20, dtype=torch.float32)
    handoff = ClosureHandoff(serialise_closure({"big": big, "view": big[10:20]}), "run", threshold=1024)
    try:
        assert handoff.path and oct(os.stat(handoff.path).st_mode & 0o777) == "0o600"
        assert len(handoff.body) < 4096  # the frame holds the pickle's structure, not the bytes
        received = receive_closure(_Frames(handoff.body))
        values = received.load(_no_feeds)
        assert torch.equal(values["big"], big) and values["view"].tolist() == list(range(10, 20))
        assert values["view"].untyped_storage().data_ptr() == values["big"].untyped_storage().data_ptr()
        values["big"].add_(1)  # copy-on-write: the file, and so every other rank, keeps the kernel's bytes
        assert float(receive_closure(_Frames(handoff.body)).load(_no_feeds)["big"][0]) == 0.0
        with open(handoff.path, "r+b") as handle:  # someone changes the file after the kernel wrote it
            handle.seek(os.path.getsize(handoff.path) // 2)
            handle.write(b"\xff")
        with pytest.raises(wire.AuthenticationError, match="does not match the digest"):
            receive_closure(_Frames(handoff.body))
    finally:
        handoff.remove()
    assert not os.path.exists(handoff.path or "/nonexistent")
