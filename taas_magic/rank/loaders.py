"""What the cell sees in a rank in place of a registered loader: prepared elements.

Runs in each rank, on the cell's thread (``for x in loader``); the frames it waits for are read by
the inbox's thread (rank/inbox.py).

The kernel pickles the cell's closure with every registered loader it reaches (at any
depth: a dict of loaders, a function's default) replaced by a reference, and the rank
rebuilds each reference as a :class:`PreparedLoader`. ``for x in loader`` starts the
rank's next pass: it asks the kernel for a few elements ahead (credit), and reads each
one from the cache segment the kernel names (records.py: no copy of tensor payloads).
Breaking out of a loop abandons the rest of that pass, as with a DataLoader.

``len(loader)`` is this rank's share of its next pass (map-style feeds). Every other
attribute (``loader.dataset``, ``loader.batch_size``) is the original loader's, loaded
from its pickle on first use.
"""

from __future__ import annotations

import collections
from typing import Any, Iterator, NoReturn

from taas_magic.protocol import Elements, End, Want
from taas_magic.rank.inbox import Inbox
from taas_magic.runspec import MAP, FeedPlan, RankFeed
from taas_magic.transfer.records import SegmentReader

CREDIT = 4  # elements a rank asks for ahead of the one it is consuming


class FeedClient:
    """A rank's end of the element stream, read through the rank's inbox (rank/inbox.py)."""

    def __init__(self, inbox: Inbox):
        self.inbox = inbox
        self.reader = SegmentReader()

    def ask(self, feed: int, pass_no: int, credit: int) -> None:
        self.inbox.send(Want(feed, pass_no, credit))

    def next_message(self, feed: int) -> Elements | End:
        """The next frame for ``feed`` (others are kept for their own loaders)."""
        frame = self.inbox.take(lambda frame: isinstance(frame, (Elements, End)) and frame.feed == feed)
        assert isinstance(frame, (Elements, End))
        return frame


class PreparedLoader:
    def __init__(self, plan: FeedPlan, original_blob: bytes, client: FeedClient):
        self._plan = plan
        self._original_blob = original_blob
        self._original: Any = None
        self._client = client
        self._next_pass = 0
        self._current: int | None = None

    def __iter__(self) -> Iterator[Any]:
        return self._elements()

    def _elements(self) -> Iterator[Any]:
        # The pass begins at the first next(), not at iter(): an iterator made only to
        # probe the loader (Lightning does) and never advanced takes nothing.
        plan, client = self._plan, self._client
        pass_no = self._next_pass
        self._next_pass += 1
        self._current = pass_no
        client.ask(plan.feed, pass_no, CREDIT)
        ready: collections.deque = collections.deque()
        consumed = 0
        while True:
            if self._current != pass_no:
                return  # a newer pass of this loader started: this one was abandoned
            if not ready:
                message = client.next_message(plan.feed)
                if message.pass_no != pass_no:
                    continue  # left over from an abandoned pass
                if isinstance(message, End):
                    return
                ready.extend(message.places)
                continue
            path, offset = ready.popleft()
            element = client.reader.read(path, offset)
            consumed += 1
            if consumed >= CREDIT // 2:
                client.ask(plan.feed, pass_no, consumed)
                consumed = 0
            yield element

    def __len__(self) -> int:
        plan = self._plan
        if plan.kind != MAP:
            raise TypeError(f"{plan.name} is an iterable loader: its passes have no length known in advance")
        pass_no = self._next_pass
        fresh = pass_no if pass_no < plan.fresh_passes else (pass_no - plan.fresh_passes) % plan.fresh_passes
        return plan.fresh_length(fresh) // plan.ranks

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name.startswith("_PreparedLoader") or name in ("_plan", "_original", "_original_blob"):
            raise AttributeError(name)
        if self._original is None:
            import cloudpickle

            self._original = cloudpickle.loads(self._original_blob)
        return getattr(self._original, name)

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        raise TypeError(f"{self._plan.name} is a taas prepared loader: it lives in its rank and cannot be pickled")

    def __repr__(self) -> str:
        return f"<taas prepared loader {self._plan.describe()}>"


def prepared_loaders(feeds: tuple[RankFeed, ...], inbox: Inbox) -> dict[int, PreparedLoader]:
    """Feed index -> the :class:`PreparedLoader` the closure's ``("taas-feed", i)`` resolves to."""
    if not feeds:
        return {}
    client = FeedClient(inbox)
    return {feed.plan.feed: PreparedLoader(feed.plan, feed.original, client) for feed in feeds}
