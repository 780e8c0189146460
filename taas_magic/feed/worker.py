"""A data worker's life: ``python -m taas_magic.feed.worker``.

Runs in each data worker (``python -m taas_magic.feed.worker``), on its main thread, with
rank/startup.py's lifeline, as a rank.

Started by the kernel before the ranks, like a rank (its own session, pipes, the
handshake ``HOST PORT KEY`` and its placement on stdin kept open as its lifeline: its id
on the kernel's channel and the write rule of a rank other than 0). It receives its job
(the plans and the loaders, pickled once by the kernel), then loops:

- take the next element of some feed that the kernel's horizon allows (backpressure:
  the kernel moves the horizon as the ranks consume);
- prepare it, append it to a segment (segments.py), tell the kernel where it is.

Frames from the kernel (protocol.py): ``Horizon`` (how far it may extract, and for iterable
feeds how many elements arrived), ``NextPass`` (an iterable feed's next pass may start:
every worker finished the previous one), ``Stop`` (the feed has its K elements). A worker
that fails sends its traceback as frames (``WorkerFailure``: the kernel fills in the
notebook's source lines) with the element it was preparing, and exits 1; one with nothing
left sends ``Done`` and exits 0.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

from taas_magic.feed.extract import IterableSource, MapSource, make_source, seed_worker, set_worker_info
from taas_magic.feed.segments import CacheDirs, SegmentWriter
from taas_magic.protocol import (
    Done,
    Exhausted,
    Horizon,
    Job,
    Loaders,
    NextPass,
    PeerChannel,
    Ready,
    Stop,
    WorkerFailure,
)
from taas_magic.rank import startup
from taas_magic.runspec import MAP, FeedPlan

EXIT_FAILED = 1


class _Feed:
    """One loader as this worker extracts it."""

    def __init__(self, plan: FeedPlan, source: MapSource | IterableSource):
        self.plan = plan
        self.source = source
        self.pass_no = 0
        self.horizon = plan.ahead * plan.ranks
        self.arrived = 0  # iterable: elements of every worker the kernel has counted
        self.sent = 0  # iterable: elements this worker sent
        self.counted = 0  # iterable: of those, how many the kernel had counted
        self.in_pass = 0  # elements this worker prepared in the current pass
        self.waiting_for_pass = False
        self.done = False
        self.pending: tuple[int, Any] | None = None
        source.start_pass(0)

    def describe_element(self) -> str:
        if self.plan.kind == MAP and self.pending is not None:
            return f"element {self.pending[0]} of pass {self.pass_no}"
        return f"its element {self.in_pass} of pass {self.pass_no} (counting from 0)"


def send_failure(channel: PeerChannel, feed: _Feed | None, exc: BaseException) -> None:
    """The traceback as frames (the kernel adds the notebook's source lines) and the element."""
    frames = [(f.filename, f.lineno, f.name, f.line) for f in traceback.extract_tb(exc.__traceback__)]
    channel.send(WorkerFailure(
        feed.plan.feed if feed else None,
        feed.describe_element() if feed else "its setup (loading the loaders)",
        frames,
        "".join(traceback.format_exception_only(type(exc), exc)),
    ))


class Worker:
    def __init__(self, channel: PeerChannel, job: Job, loaders: dict[int, Any]):
        self.channel = channel
        self.worker = job.worker
        seed_worker(job.seed, self.worker)
        self.writer = SegmentWriter(CacheDirs(*job.dirs), self.worker, job.ram_budget, job.segment_bytes)
        self.feeds: dict[int, _Feed] = {}
        self.current: _Feed | None = None
        for plan in job.plans:
            loader = loaders[plan.feed]
            if plan.kind != MAP:
                set_worker_info(loader, self.worker, job.workers, plan.seed)
            self.current = feed = _Feed(plan, make_source(plan, loader, self.worker))
            self.feeds[plan.feed] = feed

    # -- messages from the kernel ----------------------------------------------------------
    def _receive(self, block: bool) -> None:
        while self.channel.readable(None if block else 0.0):
            frame = self.channel.receive()
            match frame:
                case Horizon():
                    feed = self.feeds[frame.feed]
                    feed.horizon, feed.arrived, feed.counted = frame.horizon, frame.arrived, frame.counted
                case NextPass():
                    feed = self.feeds[frame.feed]
                    feed.pass_no, feed.in_pass, feed.waiting_for_pass = frame.pass_no, 0, False
                    feed.source.start_pass(feed.pass_no)
                case Stop():
                    self.feeds[frame.feed].done = True
            block = False

    # -- extraction ------------------------------------------------------------------------------
    def _step(self, feed: _Feed) -> bool:
        """Prepare one element of ``feed`` if allowed; True if anything changed."""
        self.current = feed
        if feed.plan.kind == MAP:
            return self._step_map(feed)
        return self._step_iterable(feed)

    def _step_map(self, feed: _Feed) -> bool:
        source = feed.source
        assert isinstance(source, MapSource)
        if feed.pending is None:
            feed.pending = source.next_index()
            if feed.pending is None:
                if feed.pass_no + 1 >= feed.plan.fresh_passes:
                    feed.done = True
                else:
                    feed.pass_no += 1
                    source.start_pass(feed.pass_no)
                return True
        j, index = feed.pending
        if feed.plan.stream_offset(feed.pass_no) + j >= feed.horizon:
            return False
        element = source.fetch(index)
        path, offset = self.writer.append(element)
        self.channel.send(Ready(feed.plan.feed, feed.pass_no, j, path, offset))
        feed.pending = None
        return True

    def _step_iterable(self, feed: _Feed) -> bool:
        if feed.waiting_for_pass or feed.arrived + (feed.sent - feed.counted) >= feed.horizon:
            return False
        source = feed.source
        assert isinstance(source, IterableSource)
        try:
            element = source.next_element()
        except StopIteration:
            self.channel.send(Exhausted(feed.plan.feed, feed.pass_no))
            feed.waiting_for_pass = True
            return True
        path, offset = self.writer.append(element)
        self.channel.send(Ready(feed.plan.feed, feed.pass_no, None, path, offset))
        feed.sent += 1
        feed.in_pass += 1
        return True

    def run(self) -> None:
        while True:
            self._receive(block=False)
            active = [feed for feed in self.feeds.values() if not feed.done]
            if not active:
                break
            progressed = False
            for feed in active:
                progressed = self._step(feed) or progressed
            if not progressed:
                self._receive(block=True)
        self.writer.close()
        self.channel.send(Done(self.worker))

def main() -> None:
    channel = startup.begin()  # its dataset's code may write too: it gets a rank's write rule
    job = channel.expect(Job)
    pickles = channel.expect(Loaders).pickles
    sys.path[:] = job.sys_path
    worker: Worker | None = None
    try:
        import cloudpickle

        loaders = {feed: cloudpickle.loads(blob) for feed, blob in pickles.items()}
        worker = Worker(channel, job, loaders)
        worker.run()
    except BaseException as exc:  # noqa: BLE001 - reported to the kernel, which stops the run
        send_failure(channel, worker.current if worker else None, exc)
        startup.finish(EXIT_FAILED)
    startup.finish(0)


if __name__ == "__main__":
    main()
