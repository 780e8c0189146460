"""The kernel's bookkeeping for the data workers: pure state, no I/O.

Runs in the kernel, on a run's own thread, as the supervisor hands it frames.

The supervisor hands it the frames workers and ranks send (protocol.py: Ready, Exhausted,
Done, Want) and sends what it returns (:class:`Send`: a frame and its peer). Per feed (registered loader the cell uses) it keeps:

- where every extracted element lives (one 64-bit word each: segment id and offset),
  by fresh pass, so that replayed passes can be served without the loader;
- a cursor per rank: its pass, how many of its elements it has had, its credit (the
  rank asks for a few elements ahead, so delivery overlaps its training step);
- the horizon: workers may extract only elements less than ``ahead * N`` positions
  past the slowest rank's next one. That is the backpressure.

Element ``j`` of a pass goes to rank ``j % N``. A map-style pass has a known length, so
an element is delivered as soon as it exists; an iterable pass is delivered in whole
rounds of N (elements in arrival order), so a pass that ends leaves every rank with
the same number of elements and drops the remainder.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass
from typing import Any

from taas_magic.peers import RANK, WORKER, Peer
from taas_magic.protocol import Done, Elements, End, Exhausted, Horizon, NextPass, Ready, Stop, ToPeer, Want
from taas_magic.runspec import MAP, FeedPlan, delivered_length

END = -2
OFFSET_BITS = 40


@dataclass(frozen=True)
class Send:
    to: Peer
    frame: ToPeer


def _to_worker(worker: int, frame: ToPeer) -> Send:
    return Send(Peer(WORKER, worker), frame)


def _to_rank(rank: int, frame: ToPeer) -> Send:
    return Send(Peer(RANK, rank), frame)


class _Pass:
    def __init__(self, length: int | None):
        self.length = length  # delivered length D; None until an iterable pass ends
        self.locations = array("q", [-1]) * length if length is not None else array("q")
        self.count = 0  # elements extracted
        self.exhausted: set[int] = set()  # iterable: workers whose iterator ended


class _Cursor:
    def __init__(self) -> None:
        self.pass_no = -1  # -1: the rank has not asked yet (it will start with pass 0)
        self.position = 0  # elements of the pass delivered to this rank
        self.credit = 0
        self.ended = False


class _Feed:
    def __init__(self, plan: FeedPlan):
        self.plan = plan
        self.passes: list[_Pass] = []
        self.paths: list[str] = []
        self.path_ids: dict[str, int] = {}
        self.extracted = 0
        self.delivered_fresh = 0
        self.replayed = 0
        self.finished = False
        self.fresh_count = plan.fresh_passes if plan.kind == MAP else None
        self.cursors = [_Cursor() for _ in range(plan.ranks)]
        self.arrived_by_worker = [0] * plan.workers
        self.orders: dict[int, Any] = {}
        self.horizon = plan.ahead * plan.ranks
        self.horizon_step = max(1, plan.ahead * plan.ranks // 4)

    # -- passes and locations ---------------------------------------------------------
    def fresh_pass(self, number: int) -> _Pass:
        while len(self.passes) <= number:
            index = len(self.passes)
            self.passes.append(_Pass(self.plan.fresh_length(index) if self.plan.kind == MAP else None))
        return self.passes[number]

    def encode(self, path: str, offset: int) -> int:
        path_id = self.path_ids.get(path)
        if path_id is None:
            path_id = self.path_ids[path] = len(self.paths)
            self.paths.append(path)
        return path_id << OFFSET_BITS | offset

    def decode(self, location: int) -> tuple[str, int]:
        return self.paths[location >> OFFSET_BITS], location & ((1 << OFFSET_BITS) - 1)

    def is_replay(self, pass_no: int) -> bool | None:
        """True / False, or None while that is not known yet."""
        if self.fresh_count is not None and pass_no < self.fresh_count:
            return False
        if self.finished:
            return True
        return None if self.plan.kind == MAP else False  # iterable: extraction goes on into it

    def replay_order(self, pass_no: int, cached: _Pass) -> Any:
        if not self.plan.shuffle:
            return None
        order = self.orders.get(pass_no)
        if order is None:
            assert cached.length is not None
            order = self.plan.replay_order(pass_no, cached.length)
            self.orders[pass_no] = order
            live = {cursor.pass_no for cursor in self.cursors}
            for old in [number for number in self.orders if number not in live and number != pass_no]:
                del self.orders[old]
        return order

    def next_location(self, rank: int, cursor: _Cursor) -> int | None:
        """The location of the rank's next element, END, or None (not extracted yet)."""
        ranks = self.plan.ranks
        j = cursor.position * ranks + rank
        replay = self.is_replay(cursor.pass_no)
        if replay is None:
            return None
        if not replay:
            this = self.fresh_pass(cursor.pass_no)
            if this.length is not None and cursor.position * ranks >= this.length:
                return END
            if self.plan.kind == MAP:
                location = this.locations[j]
                return None if location < 0 else location
            return this.locations[j] if (cursor.position + 1) * ranks <= this.count else None
        if not self.fresh_count:
            return END  # nothing was extracted at all
        assert self.fresh_count is not None
        cached = self.passes[(cursor.pass_no - self.fresh_count) % self.fresh_count]
        assert cached.length is not None
        if cursor.position * ranks >= cached.length:
            return END
        order = self.replay_order(cursor.pass_no, cached)
        return cached.locations[order[j] if order is not None else j]

    def position_of(self, rank: int, cursor: _Cursor) -> float:
        """Where the rank's next fresh element sits in extraction order (inf: replaying)."""
        pass_no = cursor.pass_no + 1 if cursor.ended else max(cursor.pass_no, 0)
        position = 0 if cursor.ended else cursor.position
        if self.is_replay(pass_no):
            return float("inf")
        ranks = self.plan.ranks
        if self.plan.kind == MAP:
            if pass_no >= (self.fresh_count or 0):
                return float("inf")
            return self.plan.stream_offset(pass_no) + position * ranks + rank
        before = sum(p.count for p in self.passes[:pass_no])
        return before + position * ranks + rank


class FeedCoordinator:
    def __init__(self, plans: list[FeedPlan]):
        self.feeds = {plan.feed: _Feed(plan) for plan in plans}
        self.started = time.monotonic()
        self.workers_done: set[int] = set()
        self.restarts = 0  # times the ranks started again

    @property
    def workers(self) -> int:
        return next(iter(self.feeds.values())).plan.workers if self.feeds else 0

    def name_of(self, feed: int | None) -> str:
        return self.feeds[feed].plan.name if feed in self.feeds else "the registered loaders"

    # -- from workers -------------------------------------------------------------------
    def on_worker(self, worker: int, frame: Ready | Exhausted | Done) -> list[Send]:
        match frame:
            case Done():
                self.workers_done.add(worker)
                return []
            case Ready(feed=feed_id, pass_no=pass_no, index=j, path=path, offset=offset):
                feed = self.feeds[feed_id]
                sends = self._on_ready(feed, worker, pass_no, j, feed.encode(path, offset))
            case Exhausted(feed=feed_id, pass_no=pass_no):
                feed = self.feeds[feed_id]
                sends = self._on_exhausted(feed, worker, pass_no)
        return sends + self._pump(feed) + self._horizon(feed)

    def _on_ready(self, feed: _Feed, worker: int, pass_no: int, j: int | None, location: int) -> list[Send]:
        if feed.finished:
            return []  # an iterable feed's worker overshot K: the element is not used
        this = feed.fresh_pass(pass_no)
        if j is None:
            this.locations.append(location)
        else:
            this.locations[j] = location
        this.count += 1
        feed.extracted += 1
        feed.arrived_by_worker[worker] += 1
        if feed.plan.kind == MAP:
            feed.finished = feed.extracted == feed.plan.total_delivered()
            return []
        if feed.extracted < feed.plan.units:
            return []
        this.length = delivered_length(this.count, feed.plan.ranks)
        return self._finish_iterable(feed, pass_no + 1)

    def _on_exhausted(self, feed: _Feed, worker: int, pass_no: int) -> list[Send]:
        if feed.finished:
            return []
        this = feed.fresh_pass(pass_no)
        this.exhausted.add(worker)
        if len(this.exhausted) < feed.plan.workers:
            return []
        this.length = delivered_length(this.count, feed.plan.ranks)
        if this.length == 0:  # the loader has nothing (left) for a pass: the fresh passes end here
            return self._finish_iterable(feed, pass_no)
        feed.fresh_pass(pass_no + 1)
        return [_to_worker(w, NextPass(feed.plan.feed, pass_no + 1)) for w in range(feed.plan.workers)]

    def _finish_iterable(self, feed: _Feed, fresh_count: int) -> list[Send]:
        feed.finished = True
        feed.fresh_count = fresh_count
        del feed.passes[fresh_count:]
        return [_to_worker(w, Stop(feed.plan.feed)) for w in range(feed.plan.workers)]

    def restart_ranks(self) -> None:
        """New rank processes (--restarts) read every feed from its first element again: each is
        delivered from where the workers stored it, so nothing is prepared twice."""
        self.restarts += 1
        for feed in self.feeds.values():
            feed.cursors = [_Cursor() for _ in range(feed.plan.ranks)]
            feed.delivered_fresh = 0  # "waiting" counts what these ranks have not had yet

    # -- from ranks -----------------------------------------------------------------------
    def on_rank(self, rank: int, want: Want) -> list[Send]:
        feed, pass_no, credit = self.feeds[want.feed], want.pass_no, want.credit
        cursor = feed.cursors[rank]
        if pass_no != cursor.pass_no:
            cursor.pass_no, cursor.position, cursor.credit, cursor.ended = pass_no, 0, credit, False
        else:
            cursor.credit += credit
        return self._pump(feed) + self._horizon(feed)

    # -- delivery and backpressure ---------------------------------------------------------
    def _pump(self, feed: _Feed) -> list[Send]:
        sends = []
        for rank, cursor in enumerate(feed.cursors):
            batch: list[tuple[str, int]] = []
            ended = False
            while cursor.credit > 0 and not cursor.ended and cursor.pass_no >= 0:
                location = feed.next_location(rank, cursor)
                if location is None:
                    break
                if location == END:
                    cursor.ended = ended = True
                    break
                batch.append(feed.decode(location))
                cursor.position += 1
                cursor.credit -= 1
                if feed.is_replay(cursor.pass_no):
                    feed.replayed += 1
                else:
                    feed.delivered_fresh += 1
            if batch:
                sends.append(_to_rank(rank, Elements(feed.plan.feed, cursor.pass_no, batch)))
            if ended:
                sends.append(_to_rank(rank, End(feed.plan.feed, cursor.pass_no)))
        return sends

    def _horizon(self, feed: _Feed) -> list[Send]:
        slowest = min(feed.position_of(rank, cursor) for rank, cursor in enumerate(feed.cursors))
        if feed.finished or slowest == float("inf"):
            return []
        horizon = int(slowest) + feed.plan.ahead * feed.plan.ranks
        if horizon < feed.horizon + feed.horizon_step:
            return []
        feed.horizon = horizon
        return [
            _to_worker(w, Horizon(feed.plan.feed, horizon, feed.extracted, feed.arrived_by_worker[w]))
            for w in range(feed.plan.workers)
            if w not in self.workers_done
        ]

    # -- progress ---------------------------------------------------------------------------
    def figures(self) -> list[dict]:
        """Per feed: extracted, target (what extraction will deliver: K less the dropped
        remainders of a map-style feed), waiting (extracted, not yet delivered), replayed."""
        out = []
        for feed in self.feeds.values():
            dropped = sum(p.count - p.length for p in feed.passes if p.length is not None and p.count >= p.length)
            out.append({
                "name": feed.plan.name,
                "extracted": feed.extracted,
                "target": feed.plan.total_delivered() if feed.plan.kind == MAP else feed.plan.units,
                "waiting": max(0, feed.extracted - feed.delivered_fresh - dropped),
                "replayed": feed.replayed,
                "finished": feed.finished,
            })
        return out
