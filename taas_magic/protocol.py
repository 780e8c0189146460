"""Every frame between the kernel and its peers (ranks, data workers), one frozen dataclass each.

Runs in the kernel (a run's own thread), each rank and each data worker. A frame's base class is its direction:
:class:`ToPeer` (the kernel sends it, a peer reads it) or :class:`ToKernel`; its ``KIND`` is its name in the clear (wire.py:
``kind_len | kind | pickle``). Readers dispatch on a frame's type (``match frame: case Report(): ...``), never on a string.

The stages' frames are defined here; a feature's frames by the feature, beside the code that sends them (marked
[module] below): a new feature adds its frames without touching this module. A kind decodes once its module is
imported: the kernel's supervisor imports every frame a peer sends, a rank's main every frame the kernel sends a rank
(tests/unit/test_protocol.py asserts both, each in a fresh interpreter).

Kernel -> peer::

    Spec            the run's RunSpec                                     every rank, first
    Closure         the closure's pickle, the places and digests of its bytes      every rank   [transfer/handoff]
    ClosureHostCopy answer to ClosureHostWanted: a memory file, or why not  a rank that asked  [transfer/handoff]
    Released        rank 0's CUDA storages are copied: it may exit                    rank 0   [transfer/returns]
    SendHost        rank 0 must send its results again through host memory            rank 0   [transfer/returns]
    Elements, End   a rank's prepared elements of one pass; its pass is over   a rank (feeds)
    Job, Loaders    a data worker's plans and its loaders' pickles         every worker, first
    Horizon         how far a worker may extract                                     workers
    NextPass, Stop  an iterable feed's next pass may start; a feed has its elements  workers
    Suggested       answer to Suggest: the trial's value for that name, or why not     a rank   [search/trial]
    Answer          the person's line at a rank's pdb prompt, or None: nobody can be prompted   a rank
    Hold            a rank is in pdb: raise every group's timeout (or put them back)  the other ranks
    Interrupt       the person interrupted a kept cell: SIGINT, as a terminal's ^C     every kept rank
    Abandon         a kept cell failed or was interrupted: its collectives end, its groups are renewed  every kept rank
    ClockTime       answer to ClockAsk: the kernel's wall clock (--profile)           a rank   [profiling/window]
    PanelCommand    the debugger panel's request for a stopped rank (stackTrace, continue, ...)  a rank  [debugger/ranklink]
    PanelNow        the panel's breakpoints now, or pause: for a rank that runs      every rank   [debugger/ranklink]

Peer -> kernel::

    RankError       the cell raised (summary, traceback, the exception's signature)   a rank
    Display, ClearOutput   rich output, numbered for the marker in the rank's text    a rank   [output/relay]
    Report          a batch of taas.report calls and perhaps the rank's health         a rank   [output/reports]
    Result          what rank 0's cell bound, and where the bytes are                 rank 0   [transfer/returns]
    ClosureHostWanted  the closure's CUDA IPC handles did not open here               a rank   [transfer/handoff]
    Want            credit: a rank asks for more elements of a pass                   a rank
    Ready, Exhausted, Done   a worker stored an element; its pass ended; it is done  a worker
    WorkerFailure   a worker's traceback and the element it was preparing           a worker
    Suggest         a trial's taas.trial().suggest_*: asked once per trial, the same value to every rank  a rank  [search/trial]
    Prompt          pdb's output since its last command, and its prompt: a line is wanted    a rank
    Resumed         the rank left pdb (continue, or nobody to prompt)                          a rank
    CheckpointSaved a collective save's folder, written in place by every rank        a rank   [writes/savers]
    FilePart        a piece of a file for the repository, from a host that does not see it  a rank  [writes/outbox]
    CellDone        a kept rank ended its cell (after its results and its error) and waits for the next  a rank
    ClockAsk        --profile: the kernel's wall clock, asked to align the rank's trace   a rank   [profiling/window]
    ProfileTrace    --profile: the rank's trace of its window, gzipped, and its clock's offset  a rank  [profiling/window]
    PanelStopped    the rank stopped at a breakpoint, a step or a pause (a stopped event)  a rank  [debugger/tracer]
    PanelReply      a stopped rank's answer to a PanelCommand: a DAP body, or why not  a rank  [debugger/tracer]
    PanelResumed    the rank runs again after a stop (the panel's continued event)  a rank  [debugger/tracer]

IMPORTANT: authentication stays in wire.py and comes first. :func:`decode` is given only a body whose MAC wire.py
verified; it refuses an unknown kind, or one of the other direction (:class:`ProtocolError`), before unpickling anything,
and a pickle that is not its kind's frame after. Frames are pickled whole (protocol 5): the hot ones pay no conversion."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from taas_magic import wire
from taas_magic.runspec import FeedPlan, RunSpec

KINDS: dict[str, type[Frame]] = {}  # KIND -> frame class, filled as the classes are defined
NO_NUMBER = -1  # a display the kernel publishes itself (the board, the data line): no marker places it


class ProtocolError(ConnectionError):
    """A frame of an unknown kind, of the other direction, or not its kind's (a bug, not an attack: the MAC was good)."""


class Frame:
    """One message on the channel; subclasses are frozen dataclasses."""

    KIND: ClassVar[str]
    DIRECTION: ClassVar[bytes]  # wire.KERNEL_TO_RANK or wire.RANK_TO_KERNEL, as the MAC covers it

    def __init_subclass__(cls, kind: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if kind:
            assert kind not in KINDS, f"two frames named {kind!r}"
            cls.KIND = kind
            KINDS[kind] = cls


class ToPeer(Frame):
    """Sent by the kernel to a rank or a data worker."""
    DIRECTION = wire.KERNEL_TO_RANK


class ToKernel(Frame):
    """Sent by a rank or a data worker to the kernel."""
    DIRECTION = wire.RANK_TO_KERNEL


F = TypeVar("F", bound=Frame)


# -- kernel -> peer ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec(ToPeer, kind="spec"):
    spec: RunSpec


@dataclass(frozen=True)
class Elements(ToPeer, kind="elements"):
    feed: int
    pass_no: int
    places: list[tuple[str, int]]  # (segment path, offset) of each element, in order


@dataclass(frozen=True)
class End(ToPeer, kind="end"):
    feed: int
    pass_no: int


@dataclass(frozen=True)
class NextPass(ToPeer, kind="pass"):
    feed: int
    pass_no: int


@dataclass(frozen=True)
class Job(ToPeer, kind="job"):
    """A data worker's share of the run (kernel/supervision/dataplane.py)."""

    worker: int
    workers: int
    seed: int
    plans: list[FeedPlan]
    dirs: tuple[str, str]  # the cache's RAM and disk directories
    ram_budget: int
    segment_bytes: int
    sys_path: list[str]


@dataclass(frozen=True)
class Loaders(ToPeer, kind="loaders"):
    pickles: dict[int, bytes]  # feed -> the loader, cloudpickled once by the kernel


@dataclass(frozen=True)
class Horizon(ToPeer, kind="horizon"):
    feed: int
    horizon: int  # extract only elements before this position
    arrived: int  # iterable feeds: elements of every worker the kernel has counted
    counted: int  # of this worker's elements, how many the kernel has counted


@dataclass(frozen=True)
class Stop(ToPeer, kind="stop"):
    feed: int


@dataclass(frozen=True)
class Answer(ToPeer, kind="answer"):
    """The person's line at the rank's pdb prompt; None: nobody can be prompted, go on (rank/cellpdb.py)."""

    line: str | None


@dataclass(frozen=True)
class Interrupt(ToPeer, kind="interrupt"):
    """A kept rank's cell of run ``run`` is interrupted: SIGINT to the rank's process group (rank/betweencells.py)."""
    run: str = ""  # one that comes late, for an earlier cell's run, interrupts nothing


JOIN_VARIABLE = "TAAS_JOIN_AFTER"  # a kept rank that replaces a dead one: the run the survivors renew their group after


@dataclass(frozen=True)
class Abandon(ToPeer, kind="abandon"):
    """Kept run ``run``'s cell failed (``why``) or was interrupted: a rank still in it is interrupted, then every
    collective of its process groups ends and the groups get a new communicator before the next cell
    (rank/betweencells.py, rank/abortable.py). Every kept rank gets it, those whose cell is over too. ``lost``: the
    ranks that died, whose new processes join the default group's new communicator (its other groups are retired)."""

    run: str
    why: str
    lost: tuple[int, ...] = ()


@dataclass(frozen=True)
class Hold(ToPeer, kind="hold"):
    """``on``: a rank is in pdb, raise every process group's timeout; off: put the cell's timeouts back."""

    on: bool


# -- peer -> kernel ------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankError(ToKernel, kind="error"):
    summary: str
    traceback: str
    signature: tuple[str, str, int] | None = None  # a Python exception's (type, file, line): kernel/supervision/restarts.py
    frames: tuple = ()  # (place, line, function, {local: repr}) from the cell's frame down: %debug (rank/cellpdb.py)


@dataclass(frozen=True)
class Prompt(ToKernel, kind="prompt"):
    """A rank's pdb wants a command (rank/cellpdb.py, kernel/supervision/prompts.py)."""

    text: str  # what pdb wrote since its last command (where it stopped, a command's answer)
    prompt: str  # "(Pdb rank 1) "
    where: tuple[str, int, str]  # (place, line, function): "Cell In[5]", 3, "<module>"
    first: bool  # the first prompt of this stop
    post_mortem: str = ""  # the exception, in words, when this is a post-mortem


@dataclass(frozen=True)
class Resumed(ToKernel, kind="resumed"):
    """The rank left pdb: it runs again."""


@dataclass(frozen=True)
class CellDone(ToKernel, kind="cell-done"):
    raised: bool  # the cell raised (its RankError went first); the rank, its globals and its group are kept
    names: tuple[str, ...] = ()  # the names the rank's cells bound and it still holds (what its death would lose)
    imports: tuple[str, ...] = ()  # of those, the modules
    grouped: bool = False  # it has a default process group (a rank that replaces a dead one joins it)


@dataclass(frozen=True)
class Want(ToKernel, kind="want"):
    feed: int
    pass_no: int
    credit: int  # more elements the rank may be sent


@dataclass(frozen=True)
class Ready(ToKernel, kind="ready"):
    feed: int
    pass_no: int
    index: int | None  # map-style: the element's position in the pass; iterable: None (arrival order)
    path: str
    offset: int


@dataclass(frozen=True)
class Exhausted(ToKernel, kind="exhausted"):
    feed: int
    pass_no: int


@dataclass(frozen=True)
class Done(ToKernel, kind="done"):
    worker: int


@dataclass(frozen=True)
class WorkerFailure(ToKernel, kind="failed"):
    feed: int | None  # None: it failed loading the loaders
    element: str  # which element, in words
    frames: list[tuple[str, int | None, str, str | None]]  # (file, line, function, source) of the traceback
    exception: str


# -- encoding ------------------------------------------------------------------------------------
def encode(frame: Frame) -> bytes:
    """The body wire.py signs and sends."""
    return wire.encode_body(frame.KIND, wire.dumps(frame))


def decode(kind: str, data: bytes | memoryview, direction: type[F]) -> F:
    """The frame in a body wire.py has verified; ``direction``: ToKernel (the kernel reads) or ToPeer.
    Raises ProtocolError for an unknown kind, one of the other direction (nothing unpickled), or a pickle
    that is not a frame of that kind."""
    cls = KINDS.get(kind)
    if cls is None or not issubclass(cls, direction):
        raise ProtocolError(f"a frame of unknown kind {kind!r}" if cls is None else f"a {kind!r} frame the wrong way")
    frame = wire.loads_verified(data)
    if type(frame) is not cls:
        raise ProtocolError(f"a {kind!r} frame holding {type(frame).__name__}")
    return frame


def decode_body(body: bytes | memoryview, direction: type[F]) -> F:
    """A whole encoded body (as :func:`encode` made it), verified: its frame."""
    return decode(*wire.decode_body(body), direction)


def expect(frame: Frame, cls: type[F], what: str = "") -> F:
    """``frame`` if it is a ``cls`` (``what`` names one in the error), else ConnectionError: the ends disagree on order."""
    if not isinstance(frame, cls):
        raise ConnectionError(f"expected {what or f'a {cls.KIND!r} frame'} from the kernel, got a {frame.KIND!r} frame")
    return frame


class PeerChannel:
    """A rank's or a data worker's end of the channel: typed frames over wire.py's blocking socket."""

    def __init__(self, channel: wire.BlockingChannel):
        self._channel = channel

    def send(self, frame: ToKernel) -> None:
        self._channel.send(frame.KIND, wire.dumps(frame))

    def receive(self) -> ToPeer:
        return decode(*self._channel.recv(), ToPeer)

    def expect(self, cls: type[F], what: str = "") -> F:
        """The next frame, which must be a ``cls`` (see :func:`expect`)."""
        return expect(self.receive(), cls, what)

    def readable(self, timeout: float | None) -> bool:
        return self._channel.readable(timeout)

    def close(self) -> None:
        self._channel.close()

