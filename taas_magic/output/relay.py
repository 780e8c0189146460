"""Rank output -> the cell: incremental decoding, ``\\r`` kept, coalesced, last lines kept.

Runs in the kernel, on the run's own thread, where the supervisor feeds it each rank's bytes; a rank
imports only its marker (:func:`display_marker`, rank/shell.py).

Bytes from a rank's pipes are decoded with an incremental UTF-8 decoder (a character
split across two reads is not mangled, as IPython's ``%%script`` does). Rank 0's text
goes to the cell as it is, ``\\r`` included, so tqdm bars update in place. With
``--output all`` every rank's lines are prefixed ``[rank k] `` and only whole lines
(ended by ``\\n`` or ``\\r``) are written, so ranks never interleave inside a line.

Rich output keeps its place in the text through markers: a rank that publishes display
``n`` sends it over its channel and then writes ``\\0taas-display:n\\0`` to its own fd 1.
The relay cuts the marker out of the stream and calls ``on_marker(rank, n)`` at exactly
that point, after the text that preceded it and before the text that follows.

Text is gathered and written at most once per ``flush_interval`` per stream, so a rank
printing in a tight loop makes a bounded number of entries (about 50 a second) in the run
log (runlog.py) that every view of the run reads; the cell's budget (budget.py) is applied
where the log is shown in the cell (cellstream.py). The last lines of every rank are kept
for error reports.
"""

from __future__ import annotations

import codecs
import collections
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from taas_magic.peers import RANK, Peer, PeerIds
from taas_magic.protocol import NO_NUMBER, ToKernel


# -- this feature's frames (protocol.py frames them, and lists every frame) --------------------
@dataclass(frozen=True)
class Display(ToKernel, kind="display"):
    """A display_data (or update_display_data) message for the cell."""

    data: dict
    metadata: dict
    transient: dict
    update: bool
    number: int = NO_NUMBER  # the rank's count: its marker places it among the rank's text (output/relay.py)


@dataclass(frozen=True)
class ClearOutput(ToKernel, kind="clear_output"):
    wait: bool
    number: int = NO_NUMBER


RANK_0 = Peer(RANK, 0)

# Shows a display message in the cell (display_data, update_display_data, clear_output).
Publish = Callable[[Display | ClearOutput], None]


class TextOut(Protocol):
    """Where the relay writes a stream's text: the run log's (runlog.py), or any text file."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...

KEEP_LINES = 20  # lines of each process's output kept for error reports
PARTIAL_KEEP = 4096  # characters of an unfinished line kept for error reports
_LINE_END = re.compile(r"(?<=[\n\r])")
MARKER_PREFIX = "\x00taas-display:"
_MARKER = re.compile(re.escape(MARKER_PREFIX) + "(\\d+)\x00")
_MARKER_AT_END = re.compile(re.escape(MARKER_PREFIX) + "\\d+\x00$")
_MARKER_HEAD = re.compile(re.escape(MARKER_PREFIX) + "\\d*")


def publisher(display_pub: Any) -> Publish:
    """What shows a rank's (or the kernel's own) display message through IPython's display
    publisher, ``shell.display_pub``: as ipyparallel republishes a remote display_data."""

    def publish(message: Display | ClearOutput) -> None:
        if isinstance(message, ClearOutput):
            display_pub.clear_output(wait=message.wait)
            return
        kwargs: dict[str, Any] = {"metadata": message.metadata}
        if message.transient:
            kwargs["transient"] = message.transient
        if message.update:
            kwargs["update"] = True
        display_pub.publish(message.data, **kwargs)

    return publish


CELL_END = "\x01taas-cell-end\x01"  # a kept rank's last bytes of a cell on each stream (rank/betweencells.py)


def display_marker(number: int) -> bytes:
    return f"{MARKER_PREFIX}{number}\x00".encode("ascii")


def _held_end(text: str) -> int:
    """Where ``text`` ends with the first part of :data:`CELL_END` (to hold back), or -1."""
    for length in range(min(len(CELL_END) - 1, len(text)), 0, -1):
        if text.endswith(CELL_END[:length]):
            return len(text) - length
    return -1


def _incomplete_marker_start(text: str) -> int:
    """Where ``text`` ends with the first part of a marker (to hold back), or -1."""
    start = text.rfind("\x00")
    if start == -1 or _MARKER_AT_END.search(text):
        return -1
    tail = text[start:]
    return start if MARKER_PREFIX.startswith(tail) or _MARKER_HEAD.fullmatch(tail) else -1


class _RankText:
    """Decoding and the tail of one rank's output."""

    def __init__(self, keep_lines: int):
        self.decoders = {
            name: codecs.getincrementaldecoder("utf-8")(errors="replace") for name in ("stdout", "stderr")
        }
        self.partial = {"stdout": "", "stderr": ""}
        self.marker_hold = ""
        self.end_hold = {"stdout": "", "stderr": ""}  # the first part of a cell's end, not yet whole
        self.ended: set[str] = set()  # the streams its cell ended on: closed, or (a kept rank) said so
        self.tail: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self.tail_partial = ""

    def remember(self, text: str) -> None:
        combined = self.tail_partial + text
        cut = combined.rfind("\n")
        if cut == -1:
            self.tail_partial = combined[-PARTIAL_KEEP:]  # a bar redrawn with \r forever stays bounded
            return
        self.tail_partial = combined[cut + 1 :][-PARTIAL_KEEP:]
        keep = self.tail.maxlen or 0
        # Only the last lines can matter: split off at most that many (a flood costs one rfind-like pass).
        for piece in combined[:cut].rsplit("\n", keep)[-keep:]:  # what a terminal shows: after the last \r
            self.tail.append(piece.rstrip("\r").rsplit("\r", 1)[-1])

    def last_lines(self) -> tuple[str, ...]:
        lines = list(self.tail)
        partial = self.tail_partial.rstrip("\r").rsplit("\r", 1)[-1]
        if partial:
            lines.append(partial)
        return tuple(lines[-(self.tail.maxlen or len(lines)) :])


class OutputRelay:
    def __init__(
        self,
        mode: str,
        peers: PeerIds,
        streams: dict[str, TextOut],
        *,
        flush_interval: float = 0.02,
        on_marker: Callable[[Peer, int], None] | None = None,
    ):
        """The relay of ``--output`` ``mode`` for ``peers`` into ``streams`` (the run log's), written at
        most once per ``flush_interval``; ``on_marker`` places the displays."""
        self.mode = mode
        self.streams = streams
        self.flush_interval = flush_interval
        # Every rank and data worker (a worker's output is shown only with --output all).
        self.texts = {peer: _RankText(KEEP_LINES) for peer in peers.all()}
        self.pending: dict[str, list[str]] = {name: [] for name in streams}
        self.last_flush = 0.0
        self.muted = False
        self.on_marker = on_marker

    def mute(self) -> None:
        """From now on drop everything: ranks being stopped print only noise."""
        self.muted = True
        for chunks in self.pending.values():
            chunks.clear()

    def shows(self, peer: Peer) -> bool:
        return peer == RANK_0 or self.mode == "all"

    def feed(self, peer: Peer, stream: str, data: bytes, final: bool = False) -> None:
        if self.muted:
            return
        state = self.texts[peer]
        text = state.decoders[stream].decode(data, final=final)
        if "\x01" in text or state.end_hold[stream]:  # perhaps a kept rank's cell's end: cut out, noted
            text = state.end_hold[stream] + text
            if CELL_END in text:
                state.ended.add(stream)
                text = text.replace(CELL_END, "")
            hold = -1 if final else _held_end(text)
            text, state.end_hold[stream] = (text[:hold], text[hold:]) if hold != -1 else (text, "")
        if stream == "stdout" and self.on_marker is not None:
            text = state.marker_hold + text
            hold = -1 if final else _incomplete_marker_start(text)
            text, state.marker_hold = (text[:hold], text[hold:]) if hold != -1 else (text, "")
            pieces = _MARKER.split(text)  # text, number, text, number, ..., text
            for index, piece in enumerate(pieces):
                if index % 2:
                    self.on_marker(peer, int(piece))
                else:
                    self._emit(peer, stream, piece)
            return
        self._emit(peer, stream, text)

    def _emit(self, peer: Peer, stream: str, text: str) -> None:
        if not text:  # feed() has already dropped everything while muted
            return
        state = self.texts[peer]
        state.remember(text)
        if not self.shows(peer):
            return
        if self.mode != "all":
            self.pending[stream].append(text)
            return
        pieces = _LINE_END.split(state.partial[stream] + text)
        state.partial[stream] = "" if pieces[-1].endswith(("\n", "\r")) else pieces.pop()
        self.pending[stream].extend(f"[{peer}] {piece}" for piece in pieces if piece)

    def end_of_stream(self, peer: Peer, stream: str) -> None:
        """The process closed this pipe: emit its undecoded bytes and unfinished line."""
        self.feed(peer, stream, b"", final=True)
        state = self.texts[peer]
        state.ended.add(stream)  # nothing more of the cell can come on it
        if self.mode == "all" and state.partial[stream]:
            self.pending[stream].append(f"[{peer}] {state.partial[stream]}\n")
            state.partial[stream] = ""

    def notice(self, line: str) -> None:
        """taas's own line in the cell (a restart, where the ranks were), after what is pending."""
        self.flush(force=True)
        self.streams["stderr"].write(line + "\n")
        self.streams["stderr"].flush()

    def last_lines(self, peer: Peer) -> tuple[str, ...]:
        return self.texts[peer].last_lines()

    def cell_ended(self, peer: Peer) -> bool:
        """Whether all the rank printed in the cell is here: each of its streams closed, or (a kept rank's) said its
        cell is over."""
        return self.texts[peer].ended == {"stdout", "stderr"}

    def has_pending(self) -> bool:
        return any(self.pending.values())

    def seconds_until_flush(self, now: float) -> float:
        if not self.has_pending():
            return float("inf")
        return max(0.0, self.last_flush + self.flush_interval - now)

    def flush(self, force: bool = False) -> None:
        if self.muted:
            return
        now = time.monotonic()
        if not self.has_pending() or (not force and now - self.last_flush < self.flush_interval):
            return
        for name, chunks in self.pending.items():
            if chunks:
                text = "".join(chunks)
                chunks.clear()
                self.streams[name].write(text)
                self.streams[name].flush()
        self.last_flush = now
