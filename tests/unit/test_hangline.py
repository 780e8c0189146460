"""The hang line's two halves without a kernel: autopsy/waiting.py on a real thread, autopsy/hangline.py's policy
with the health figures and stack dumps a run would give it."""

import importlib.util
import threading
import time

from taas_magic.autopsy import waiting
from taas_magic.autopsy.hangline import REPEAT_SECONDS, HangWatch

CELL = "<cell>"
SOURCES = {CELL: ("Cell", ["import torch.distributed as dist", "dist.broadcast(t, 0)", "dist.all_reduce(t)",
                           "time.sleep(100)"])}


def _dump(*frames: tuple[str, int, str]) -> str:
    lines = ["main 0x0000000000000001", "Current thread 0x0000000000000001 (most recent call first):"]
    lines += [f'  File "{name}", line {line} in {function}' for name, line, function in reversed(frames)]
    return "\n".join(lines) + "\n"


WAITS_IN_BROADCAST = _dump((CELL, 2, "<module>"), ("/site/torch/distributed/distributed_c10d.py", 2700, "broadcast"))
WAITS_IN_ALL_REDUCE = _dump((CELL, 3, "<module>"), ("/site/torch/distributed/distributed_c10d.py", 3252, "all_reduce"))
SLEEPS = _dump((CELL, 4, "<module>"))


def _distributed_module(tmp_path):
    """A module whose file is under a ``torch/distributed/`` folder, as a collective's frame is."""
    folder = tmp_path / "torch" / "distributed"
    folder.mkdir(parents=True)
    (folder / "waits.py").write_text("def wait(gate):\n    gate.acquire(timeout=60)  # in C, as a collective waits\n\n"
                                     "def quick():\n    return 1\n")
    spec = importlib.util.spec_from_file_location("fake_waits", folder / "waits.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sampled(action, looks: int = 4) -> list[float]:
    """``waiting.waited`` looked at from another thread while this (the main) thread runs ``action(gate, done)``:
    ``gate`` is a held lock the looking thread releases when it is done, and sets ``done``."""
    seen: list[float] = []
    gate, done = threading.Lock(), threading.Event()
    gate.acquire()

    def look() -> None:
        for _ in range(looks):
            time.sleep(0.05)
            seen.append(waiting.waited(time.monotonic()))
        done.set()
        gate.release()

    threading.Thread(target=look).start()
    action(gate, done)
    return seen


def test_one_call_waited_in_counts_up_and_a_loop_of_calls_does_not(tmp_path):
    module = _distributed_module(tmp_path)
    waited = _sampled(lambda gate, done: module.wait(gate), looks=6)
    counting = waited[next(i for i, seconds in enumerate(waited) if seconds > 0):]  # from the second look inside it
    assert len(counting) >= 3 and all(a < b for a, b in zip(counting, counting[1:])), waited

    def loop(gate: threading.Lock, done: threading.Event) -> None:
        while not done.is_set():
            module.quick()

    assert max(_sampled(loop)) == 0.0  # never the same frame twice: a new call each time
    assert max(_sampled(lambda gate, done: gate.acquire(timeout=60))) == 0.0  # not in torch.distributed: no collective


def _watch(seconds: float = 30.0) -> HangWatch:
    return HangWatch(seconds, SOURCES, CELL)


def test_the_line_is_due_past_the_threshold_once_a_minute_and_not_for_a_past_attempt():
    watch = _watch()
    watch.saw(0, {"waiting": 0.0})
    watch.saw(1, {"waiting": 25.0})
    now = time.monotonic()
    assert watch.due(now) is None
    assert round(watch.due(now + 6)) == 31  # its last figure and the time since: a rank that stopped reporting
    assert watch.due(now + 7) is None  # said: not again within the minute
    assert watch.due(now + 6 + REPEAT_SECONDS) is not None
    watch.saw(1, None)  # a report without health changes nothing
    watch.forget()  # a new attempt: the old ranks' waits are theirs no more
    assert watch.due(now + 200) is None
    watch.saw(1, {"waiting": 0.0})  # not waiting (any more)
    assert watch.due(time.monotonic() + 100) is None


def test_the_line_says_whether_the_ranks_disagree_and_names_a_rank_that_finished():
    watch = _watch()
    assert watch.line({0: WAITS_IN_BROADCAST, 1: WAITS_IN_ALL_REDUCE}, (0, 1), 2, 30.4) == (
        "taas: ranks disagree for 30 s: rank 0 waits in broadcast (line 2); rank 1 waits in all_reduce (line 3)")
    assert watch.line({0: SLEEPS, 1: WAITS_IN_ALL_REDUCE}, (0, 1), 2, 31) == (
        "taas: ranks disagree for 31 s: rank 0 is at line 4 in time.sleep; rank 1 waits in all_reduce (line 3)")
    assert watch.line({0: WAITS_IN_ALL_REDUCE, 1: WAITS_IN_ALL_REDUCE}, (0, 1), 2, 30) == (
        "taas: no rank has moved for 30 s: ranks 0, 1 wait in all_reduce (line 3)")
    assert watch.line({0: WAITS_IN_ALL_REDUCE}, (0,), 2, 30) == (
        "taas: ranks disagree for 30 s: rank 0 waits in all_reduce (line 3); rank 1 finished the cell")


def test_ranks_on_a_host_that_does_not_see_the_repository_are_named_where_the_ranks_disagree():
    watch = _watch()
    watch.saw(1, {"waiting": 31.0, "away": True})
    assert watch.line({0: WAITS_IN_BROADCAST, 1: WAITS_IN_ALL_REDUCE}, (0, 1), 2, 31) == (
        "taas: ranks disagree for 31 s: rank 0 waits in broadcast (line 2); rank 1 waits in all_reduce (line 3) "
        "(rank 1 runs on a host that does not see the repository: what rank 0 wrote is not there)")
    assert "does not see" not in watch.line({0: WAITS_IN_ALL_REDUCE, 1: WAITS_IN_ALL_REDUCE}, (0, 1), 2, 31)


def test_nothing_is_due_while_a_rank_is_at_a_prompt_and_the_waits_count_from_its_end():
    watch = _watch()
    watch.saw(1, {"waiting": 100.0})  # held in a barrier while rank 0 is at its prompt
    now = time.monotonic()
    assert watch.due(now, held=True) is None
    assert watch.due(now + 10) is None  # 10 s since the prompt ended, though the barrier began 110 s ago
    assert round(watch.due(now + 31)) == 31
