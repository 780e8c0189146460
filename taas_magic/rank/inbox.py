"""The rank's one reader of its channel during the cell, for the frames it waits for.

Runs in each rank: the reader on a daemon thread of its own (``taas-inbox``), :meth:`Inbox.take` on
whichever thread of the cell waits.

Several parts of a rank wait for frames from the kernel while the cell runs: its prepared
loaders (``Elements``, ``End``: rank/loaders.py), a search's trial (``Suggested``:
search/trial.py), the debugger's prompt (``Answer``: rank/cellpdb.py) and rank 0 handing
back CUDA storages (``Released``, ``SendHost``: transfer/returns.py). Any of them may see a
frame meant for another (the kernel sends elements ahead, on credit), so none reads the
channel itself: a daemon thread reads every frame as it arrives, and :meth:`Inbox.take`
waits until one it wants is there, leaving the others, in order, for whoever wants them next.

Some frames must act while the cell's own thread is busy, perhaps inside a collective that
waits for a rank stopped at a prompt: those (``Hold``) go to the handler registered for
their type (:meth:`Inbox.on`), on the reader's thread, and are not kept.
"""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any, Callable, TypeVar

from taas_magic.protocol import PeerChannel, ToKernel, ToPeer

F = TypeVar("F", bound=ToPeer)


class Inbox:
    def __init__(self, channel: PeerChannel, handlers: dict[type, Callable[[Any], None]] | None = None):
        """``handlers``: frame type -> what acts on it as it arrives (known before the first frame is read)."""
        self.channel = channel
        self._kept: list[ToPeer] = []
        self._arrived = threading.Condition()
        self._closed: BaseException | None = None  # why the channel ended, once it did
        self._handlers: dict[type, Callable[[Any], None]] = dict(handlers or {})
        self._reader = threading.Thread(target=self._read, name="taas-inbox", daemon=True)
        self._reader.start()

    def on(self, kind: type[F], handler: Callable[[F], None]) -> None:
        """Frames of ``kind`` go to ``handler`` on the reader's thread, as they arrive."""
        self._handlers[kind] = handler

    def send(self, frame: ToKernel) -> None:
        self.channel.send(frame)

    def _read(self) -> None:
        while True:
            try:
                frame = self.channel.receive()
            except BaseException as exc:  # noqa: BLE001 - the channel ended (or a bad frame): every take() raises it
                with self._arrived:
                    self._closed = exc
                    self._arrived.notify_all()
                return
            handler = self._handlers.get(type(frame))
            if handler is not None:
                try:
                    handler(frame)
                except Exception:  # noqa: BLE001 - a handler's failure must not end the reader (loaders wait on it)
                    traceback.print_exc()
                continue
            with self._arrived:
                self._kept.append(frame)
                self._arrived.notify_all()

    @property
    def ended(self) -> bool:
        """Whether the channel ended (the kernel closed it, or a bad frame came)."""
        with self._arrived:
            return self._closed is not None

    def take(self, wanted: Callable[[ToPeer], bool], timeout: float | None = None,
             drop_older: bool = False) -> ToPeer | None:
        """The first frame, kept or still to come, that ``wanted`` accepts; the others stay kept (those
        that came before it are dropped with ``drop_older``: a kept rank's last cell's). None when
        ``timeout`` seconds passed first.

        Raises:
            OSError (or what the reader met): the channel ended before such a frame came.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._arrived:
            while True:
                for index, frame in enumerate(self._kept):
                    if wanted(frame):
                        if drop_older:
                            del self._kept[:index]
                            return self._kept.pop(0)
                        return self._kept.pop(index)
                if self._closed is not None:
                    raise self._closed
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._arrived.wait(left)
