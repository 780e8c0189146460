"""Peers are typed: one numbering on the wire (ranks first, then data workers), defined once."""

import re
from pathlib import Path

import pytest

from taas_magic.peers import RANK, WORKER, HubChannels, Peer, PeerIds

PACKAGE = Path(__file__).resolve().parents[2] / "taas_magic"


def test_wire_ids_number_ranks_then_workers_and_round_trip():
    ids = PeerIds(ranks=3, workers=2)
    assert ids.all() == [Peer(RANK, 0), Peer(RANK, 1), Peer(RANK, 2), Peer(WORKER, 0), Peer(WORKER, 1)]
    assert [ids.wire_id(peer) for peer in ids.all()] == [0, 1, 2, 3, 4]
    assert str(Peer(WORKER, 1)) == "worker 1" and str(Peer(RANK, 0)) == "rank 0"
    with pytest.raises(ValueError, match="no peer 5"):
        ids.peer(5)


def test_no_module_but_peers_does_arithmetic_on_peer_ids():
    offsets = re.compile(r"world_size \+ |- self\.world_size|first_peer|ranks \+ worker|2 \* (world|rank)")
    found = [f"{path.relative_to(PACKAGE)}:{number}" for path in PACKAGE.rglob("*.py") if path.name != "peers.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if offsets.search(line)]
    assert not found, found


def test_hub_channels_number_each_ranks_streams_then_each_hosts_control():
    channels = HubChannels(ranks=3, hosts=2)
    streams = [channels.stream(rank, stream) for rank in range(3) for stream in ("stdout", "stderr")]
    controls = [channels.control(host) for host in range(2)]
    assert streams + controls == list(range(len(channels))) == list(range(8))
