"""A kept rank between its cells (taas_magic/rank/betweencells.py), in a real child process over a real
authenticated channel (tests/unit/rankside.py): it ends its cell's output on both streams (what Python and C still
buffered first), says ``CellDone`` (and whether the cell raised), drops what the last cell left, and runs the next
cell's spec and closure; the kernel's ``Interrupt`` raises KeyboardInterrupt in the cell's code (and reaches what the
cell started, as a terminal's ^C does) while the rank lives on, is ignored between cells, and, come during the next
cell's set-up, is raised as its code begins; a closed channel lets the rank go, and a next cell that cannot be
received is an error.

The child is a kept rank reduced to its loop (rank/main.py's, without the parts other tests cover): connect, then
``between_cells``, the cell's set-up, ``cell_starts``, the cell, ``cell_ends``, again. It runs in a session of its own,
so the SIGINT it sends its process group never reaches pytest."""

from __future__ import annotations

import os
import select
import signal
import sys
import time

import pytest

from taas_magic import protocol
from taas_magic.cell.closure import serialise_closure
from taas_magic.output.relay import CELL_END
from taas_magic.protocol import Abandon, Answer, CellDone, Elements, Interrupt, Resumed, Spec, ToPeer
from taas_magic.rank import betweencells  # noqa: F401 - the module under test, run by the child below
from taas_magic.runspec import RunSpec
from taas_magic.transfer.handoff import ClosureHandoff, ClosureHostCopy
from tests.unit import rankside
from tests.unit.rankside import WAIT, KernelEnd

RANK = r'''
import ctypes, faulthandler, signal, sys, traceback
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test that waited in vain asks where the rank is
from taas_magic import protocol, wire
from taas_magic.protocol import Abandon, Answer, Interrupt, Resumed
from taas_magic.rank import betweencells
from taas_magic.rank.inbox import Inbox

handshake = wire.Handshake.parse(sys.stdin.readline())
channel = protocol.PeerChannel(wire.BlockingChannel.connect(handshake.host, handshake.port, handshake.key, 0))
inbox = Inbox(channel, {Interrupt: betweencells.interrupted, Abandon: betweencells.abandoned})
signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the cell's code begins, as rank/main.py does
print("first cell", end="")  # still in Python's buffer,
ctypes.CDLL(None).printf(b" from C")  # and in C's (stdout is a pipe: fully buffered)
sys.stderr.write("warned")
raised = False
namespace = {}
while True:
    try:
        cell = betweencells.between_cells(inbox, raised, 0, namespace)
    except Exception as exc:
        print(f"could not receive the next cell: {type(exc).__name__}: {exc}", flush=True)
        sys.exit(3)
    if cell is None:
        print("let go", flush=True)
        sys.exit(0)
    spec, received = cell
    namespace = {"__name__": "__main__", "_inbox": inbox, **received.load(lambda index: None)}
    raised = False
    try:
        if spec.source.startswith("#setup-waits"):  # says it is in the set-up, which goes on until an Answer comes
            inbox.send(Resumed())
            inbox.take(lambda frame: isinstance(frame, Answer))
        betweencells.cell_starts(spec.run_id)
        exec(compile(spec.source, spec.filename, "exec"), namespace)
    except BaseException as exc:
        print(f"the cell raised {type(exc).__name__}", flush=True)
        raised = True
    finally:
        betweencells.cell_ends()
'''


RUN = "run"  # the run id of each next cell


def said_done(frame: object) -> bool | None:
    """Whether a ``CellDone`` said its cell raised (None: not a CellDone)."""
    return frame.raised if isinstance(frame, CellDone) else None


def next_cell(source: str, run: str = RUN, **closure: object) -> tuple[ToPeer, ToPeer]:
    """The Spec and Closure frames of a kept cell (of ``run``: each cell's own, as the kernel's run ids are)."""
    spec = RunSpec(run_id=run, sys_path=tuple(sys.path), source=source, display_source=source, filename="<taas In[2]>",
                   device="cpu", output="rank0", suppress_final=False, kernel_pid=os.getpid(), result_file_bytes=1 << 20,
                   keep=True)
    handoff = ClosureHandoff(serialise_closure(closure), "run", threshold=1 << 20)
    assert handoff.path is None  # small: inside the frame, no file to remove
    return Spec(spec), protocol.decode_body(handoff.body, ToPeer)


class Output:
    """A child's stdout or stderr, read as it comes."""

    def __init__(self, stream) -> None:
        self.fd = stream.fileno()
        self.text = ""

    def until(self, wanted: str, timeout: float = WAIT) -> str:
        """Everything read so far, once it holds ``wanted``."""
        deadline = time.monotonic() + timeout
        while wanted not in self.text:
            left = deadline - time.monotonic()
            assert left > 0, f"never said {wanted!r}: {self.text!r}"
            if select.select([self.fd], [], [], left)[0]:
                chunk = os.read(self.fd, 65536)
                assert chunk, f"ended before saying {wanted!r}: {self.text!r}"
                self.text += chunk.decode()
        return self.text


@pytest.fixture
def kept():
    """(the kernel's end of the rank's channel, the rank's process, its stdout, its stderr), once the rank said its
    first cell is done; the rank's session is killed after the test."""
    kernel = KernelEnd()
    child = rankside.start(RANK, kernel.handshake())
    try:
        rank = kernel.accept()
        assert said_done(rank.receive()) is False
        yield rank, child, Output(child.stdout), Output(child.stderr)
        rank.close()
    finally:
        rankside.end(child)
        kernel.close()


def test_the_cells_end_follows_what_python_and_c_still_buffered_on_both_streams(kept):
    _, _, out, err = kept
    assert out.until(CELL_END) == "first cell from C" + CELL_END
    assert err.until(CELL_END) == "warned" + CELL_END


def test_the_next_cell_runs_with_its_closure_and_says_it_is_done(kept):
    rank, _, out, _ = kept
    rank.send(*next_cell("import os\nprint(x + 1)", x=41))
    done = rank.receive()
    assert said_done(done) is False
    assert (done.names, done.imports, done.grouped) == (("x",), ("os",), False), done  # what its death would lose
    assert out.until(CELL_END + "42\n" + CELL_END).endswith(CELL_END + "42\n" + CELL_END)


def test_a_cell_that_raised_says_so_and_the_rank_waits_for_the_next(kept):
    rank, _, out, _ = kept
    rank.send(*next_cell("1 / 0"))
    assert said_done(rank.receive()) is True
    rank.send(*next_cell("print('next')"))
    assert said_done(rank.receive()) is False
    assert "the cell raised ZeroDivisionError\n" + CELL_END + "next\n" + CELL_END in out.until("next\n" + CELL_END)


def test_closing_the_channel_lets_the_kept_rank_go(kept):
    rank, child, out, _ = kept
    rank.close()
    assert out.until("let go\n").endswith(CELL_END + "let go\n")
    assert child.wait(WAIT) == 0


def test_an_interrupt_raises_in_the_cells_code_and_reaches_what_it_started_and_the_rank_lives_on(kept):
    rank, child, out, _ = kept
    rank.send(*next_cell("import subprocess, time\nsleeper = subprocess.Popen(['sleep', '60'])\n"
                         "print('started', sleeper.pid, flush=True)\ntime.sleep(60)\n"))
    line = out.until("\n").split(CELL_END)[-1]
    sleeper = int(line.split()[1])
    rank.send(Interrupt(RUN))
    assert said_done(rank.receive()) is True
    assert out.until("the cell raised KeyboardInterrupt\n")
    assert rankside.gone(sleeper)  # SIGINT to the rank's process group, as ^C in a terminal
    rank.send(*next_cell("print('still here')", run="the next run"))
    assert said_done(rank.receive()) is False
    assert out.until("still here\n") and child.poll() is None


def test_an_interrupt_between_cells_is_ignored_and_the_next_cell_runs_whole(kept):
    """It came late, for the cell before (its run named), after that cell had ended."""
    rank, child, out, _ = kept
    rank.send(Interrupt("the run before"))
    rank.send(*next_cell("import time\ntime.sleep(0.2)\nprint('ran whole')"))
    assert said_done(rank.receive()) is False
    assert out.until("ran whole\n") and "raised" not in out.text and child.poll() is None


def test_an_interrupt_during_the_next_cells_set_up_is_raised_as_its_code_begins(kept):
    rank, _, out, _ = kept
    rank.send(*next_cell("#setup-waits\nprint('should not run')"))
    assert rank.receive() == Resumed()  # the rank has its next cell and is setting it up
    rank.send(Interrupt(RUN), Answer(None))
    assert said_done(rank.receive()) is True
    assert out.until("the cell raised KeyboardInterrupt\n") and "should not run" not in out.text


def _done_or_where(rank, child, err) -> object:  # noqa: ANN001 - the kept fixture's parts
    """The rank's next frame; if none comes, the failure says where the rank's threads are and its signal state."""
    try:
        return rank.receive()
    except TimeoutError:
        with open(f"/proc/{child.pid}/status") as status:
            signals = [line.strip() for line in status if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))]
        child.send_signal(signal.SIGUSR1)
        time.sleep(1)
        raise AssertionError(f"no frame from the rank; {signals}; its stderr: {err.until('Thread', timeout=10)}") from None


def test_an_interrupt_sent_just_after_the_next_cells_spec_and_closure_interrupts_that_cell(kept):
    """The person interrupts at once: the Interrupt follows the cell's frames on the channel, whenever the rank reads
    it. (When the rank cleared an unnamed interrupt as it took the next spec, the inbox's reader, reading on, could
    handle this one first, and it was lost: 5 of 6 runs failed so.)"""
    rank, child, out, err = kept
    rank.send(*next_cell("import time\ntime.sleep(300)\nprint('not interrupted')"), Interrupt(RUN))
    assert said_done(_done_or_where(rank, child, err)) is True  # well before the cell's sleep ends, however loaded
    assert out.until("the cell raised KeyboardInterrupt\n") and "not interrupted" not in out.text


def test_abandon_interrupts_a_cell_still_running_and_between_cells_lets_the_next_run_whole(kept):
    """The kernel's word that a kept cell failed (keptcell.py): a rank still in it is interrupted, as by Interrupt; one
    whose cell is over only ends its groups' collectives (none here: no torch.distributed) and runs the next cell."""
    rank, _, out, _ = kept
    rank.send(*next_cell("import time\nprint('sleeping', flush=True)\ntime.sleep(300)\nprint('not interrupted')"))
    assert out.until("sleeping\n")
    rank.send(Abandon(RUN, "rank 1 raised"))
    assert said_done(rank.receive()) is True
    assert out.until("the cell raised KeyboardInterrupt\n") and "not interrupted" not in out.text
    rank.send(Abandon(RUN, "rank 1 raised"))  # between cells: nothing to interrupt
    rank.send(*next_cell("import time\ntime.sleep(0.2)\nprint('ran whole')", run="run00000002"))
    assert said_done(rank.receive(timeout=10)) is False
    assert out.until("ran whole\n")


def test_what_the_last_cell_left_on_the_channel_is_dropped(kept):
    rank, _, out, _ = kept
    rank.send(Elements(0, 3, [("/dev/shm/gone", 0)]), Answer("stale"))  # sent ahead to a loop that stopped early
    rank.send(*next_cell("print('left:', _inbox.take(lambda frame: True, timeout=0.2))"))
    assert said_done(rank.receive()) is False
    assert out.until("left: None\n")


def test_a_next_cell_that_cannot_be_received_is_an_error_while_the_channel_lives(kept):
    rank, child, out, _ = kept
    spec, _ = next_cell("print('never')")
    rank.send(spec, ClosureHostCopy(error="not the closure"))
    assert out.until("\n").endswith("could not receive the next cell: ConnectionError: expected the closure from the "
                                    "kernel, got a 'closure-host-copy' frame\n")
    assert child.wait(WAIT) == 3
