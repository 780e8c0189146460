"""The rank's one reader of its channel during the cell, for the frames it waits for.

Two parts of a rank wait for frames from the kernel while the cell runs: its prepared
loaders (``Elements``, ``End``: rank/loaders.py) and a search's trial (``Suggested``:
search/trial.py). Either may read a frame meant for the other (the kernel sends elements
ahead, on credit), so neither reads the channel itself: :meth:`Inbox.take` reads until a
frame it wants arrives and keeps the others, in order, for whoever wants them next.
"""

from __future__ import annotations

import threading
from typing import Callable

from taas_magic.protocol import PeerChannel, ToKernel, ToPeer


class Inbox:
    def __init__(self, channel: PeerChannel):
        self.channel = channel
        self._kept: list[ToPeer] = []
        self._lock = threading.Lock()

    def send(self, frame: ToKernel) -> None:
        self.channel.send(frame)

    def take(self, wanted: Callable[[ToPeer], bool]) -> ToPeer:
        """The first frame, kept or still to come, that ``wanted`` accepts; the others stay kept."""
        with self._lock:
            for index, frame in enumerate(self._kept):
                if wanted(frame):
                    return self._kept.pop(index)
            while True:
                frame = self.channel.receive()
                if wanted(frame):
                    return frame
                self._kept.append(frame)
