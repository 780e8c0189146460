"""A rank's displays, held until its text reaches them.

Runs in the kernel, on the run's own thread, with the supervisor and the relay.

A rank flushes its pipes before it sends a display frame and writes a marker in its text
(output/relay.py finds it); the frame may still arrive before or after the marker. The
display is published when the relay reaches the marker, after the text the rank printed
before it; one whose marker never came (the cell closed fd 1) is shown at the end.
"""

from __future__ import annotations

from taas_magic.output.relay import ClearOutput, Display, OutputRelay, Publish
from taas_magic.peers import Peer, PeerIds


class HeldDisplays:
    """Rich output held until the relay reaches its marker in the rank's text (output/relay.py)."""

    def __init__(self, relay: OutputRelay, publish: Publish, ids: PeerIds):
        self.relay, self.publish, self.ids = relay, publish, ids
        self.held: dict[tuple[Peer, int], Display | ClearOutput] = {}

    def keep(self, peer: Peer, frame: Display | ClearOutput) -> None:
        self.held[(peer, frame.number)] = frame

    def has(self, peer: Peer, number: int) -> bool:
        return (peer, number) in self.held

    def show(self, peer: Peer, number: int) -> None:
        shown = self.held.pop((peer, number), None)
        if shown is not None and self.relay.shows(peer):
            self.relay.flush(force=True)
            self.publish(shown)

    def show_leftovers(self) -> None:
        """Displays whose marker never came (the cell closed fd 1): show them last."""
        for peer, number in sorted(self.held, key=lambda key: (self.ids.wire_id(key[0]), key[1])):
            self.show(peer, number)
        self.held.clear()

    def forget_ranks(self) -> None:
        self.held = {key: shown for key, shown in self.held.items() if not key[0].is_rank}
