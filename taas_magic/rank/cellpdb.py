"""A rank's pdb, whose prompt is in the notebook cell (the kernel's half: kernel/supervision/prompts.py).

Runs in each rank, on the cell's thread, where pdb stops; the ``Hold`` arrives on the inbox's reader
thread (rank/inbox.py).

``breakpoint()``, ``pdb.set_trace()``, ``torch.distributed.breakpoint(rank=k)`` and, with
IPython's ``%pdb on``, an exception in the cell stop the rank in :class:`CellPdb`: the
standard library's ``pdb.Pdb``, every command as it is, whose input and output are the
kernel. Each time pdb reads a command, the rank sends what pdb wrote since the last one and
its prompt (``Prompt``) and waits for the person's line (``Answer``). The kernel answers
``None`` when nobody can be prompted (a frontend without stdin, a detached run nobody
watches, a search's trial): the rank then goes on, as ``PYTHONBREAKPOINT=0`` would, and the
kernel writes one line saying where it stopped. When the rank leaves pdb (``c``, or the
kernel's ``None``) it says ``Resumed``.

While any rank is in pdb, the kernel tells every other rank to hold (``Hold``): each raises
the timeout of every process group it is in (what ``torch.distributed.breakpoint`` does), so
its collectives wait for as long as the person stays; when no rank is in pdb any more, the
timeouts the cell set are put back. A collective a rank entered before the hold arrived keeps
the timeout it started with: gloo and NCCL fix a collective's timeout when it starts.

An interrupt at the prompt is not pdb's (``--KeyboardInterrupt--``, and the prompt again): it is
the kernel's stop ladder, so it ends the cell as it would anywhere else.
"""

from __future__ import annotations

import bdb
import datetime
import functools
import inspect
import io
import linecache
import pdb
import sys
import threading
from types import FrameType, ModuleType, TracebackType
from typing import Any

from taas_magic.protocol import Answer, Hold, Prompt, Resumed
from taas_magic.rank.execute import cell_label, format_cell_traceback

HELD_TIMEOUT = datetime.timedelta(days=7)  # a process group's timeout while a rank is at a prompt
LOCALS_SHOWN = 40  # %debug: at most this many locals of a frame
REPR_CHARS = 200  # %debug: each local's repr, cut to this


class _Output(io.StringIO):
    """What pdb writes, gathered until it next reads a command."""

    def take(self) -> str:
        text = self.getvalue()
        self.seek(0)
        self.truncate()
        return text


class _Input(io.StringIO):
    """pdb's stdin: each line is asked of the kernel (``use_rawinput`` is off when pdb is given one)."""

    def __init__(self, debugger: "CellPdb"):
        super().__init__()
        self.debugger = debugger

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]  # typeshed: _IOBase reads bytes
        return self.debugger.ask()


class CellPdb(pdb.Pdb):
    """pdb, prompting in the cell through the kernel (see the module docstring)."""

    def __init__(self, link: "DebugLink", post_mortem: str = ""):
        self.link = link
        self.output = _Output()
        # taas's own frames are not the person's: stepping never stops in them (off the cell's end, the rank runs on)
        super().__init__(stdin=_Input(self), stdout=self.output, skip=["taas_magic.*"], nosigint=True, readrc=False)
        self.continued = False  # continue or quit: the session is over
        self.prompt = f"(Pdb rank {link.rank}) "
        self.post_mortem = post_mortem  # the exception, in words, when this is a post-mortem
        self.where: tuple[str, int, str] = ("", 0, "")
        self.first = True
        self.alone = False  # the kernel said nobody can be prompted: go on

    def ask(self) -> str:
        if self.alone:
            return "c\n" if not self.post_mortem else "q\n"
        frame = self.curframe
        if frame is not None:
            self.where = (cell_label(frame.f_code.co_filename), frame.f_lineno, frame.f_code.co_name)
        text = self.output.take()
        text = text[: -len(self.prompt)] if text.endswith(self.prompt) else text  # input() shows the prompt
        line = self.link.ask(Prompt(text, self.prompt, self.where, self.first, self.post_mortem))
        self.first = False
        if line is None:  # nobody can be prompted: leave pdb, as PYTHONBREAKPOINT=0 would not have entered it
            self.alone = True
            return "c\n" if not self.post_mortem else "q\n"
        return line if line.endswith("\n") else line + "\n"

    def setup(self, f: FrameType | None, tb: TracebackType | None) -> None:
        """pdb's stack, from the notebook's first frame down: the rank's own frames (runpy, taas) are not the person's."""
        super().setup(f, tb)
        first = next((index for index, (frame, _) in enumerate(self.stack)
                      if cell_label(frame.f_code.co_filename) != frame.f_code.co_filename), 0)
        if 0 < first <= self.curindex:
            del self.stack[:first]
            self.curindex -= first

    def _cmdloop(self) -> None:
        self.cmdloop()  # an interrupt is the kernel's stop: not pdb's "--KeyboardInterrupt--" and a new prompt

    def format_stack_entry(self, frame_lineno: tuple[FrameType, int], lprefix: str = ": ") -> str:
        """``Cell In[5], line 3, in train``, as IPython names a notebook line; other files as pdb does."""
        frame, lineno = frame_lineno
        filename = frame.f_code.co_filename
        label = cell_label(filename)
        if label == filename:
            return super().format_stack_entry(frame_lineno, lprefix)
        text = f"{label}, line {lineno}, in {frame.f_code.co_name}"
        if "__return__" in frame.f_locals:
            text += f"->{_short_repr(frame.f_locals['__return__'])}"
        line = linecache.getline(filename, lineno, frame.f_globals)
        return text + (lprefix + line.strip() if line else "")

    def set_continue(self) -> None:
        super().set_continue()
        self.continued = True
        self.link.resumed()

    def set_quit(self) -> None:
        super().set_quit()
        self.continued = True
        self.link.resumed()

    def trace_from(self, frame: FrameType) -> None:
        """Trace from ``frame`` on, as ``set_trace`` does, without stepping first (the command already chose)."""
        while frame is not None:
            frame.f_trace = self.trace_dispatch
            self.botframe = frame
            frame = frame.f_back  # type: ignore[assignment]  # None ends the loop
        sys.settrace(self.trace_dispatch)


class DebugLink:
    """The rank's side of the prompt: one question at a time to the kernel, over the rank's inbox.
    One thread of the rank is in pdb at a time (pdb traces one): a breakpoint another thread reaches
    meanwhile is passed over."""

    def __init__(self, rank: int, inbox: Any, post_mortem: bool, cell_file: str):
        self.rank, self.send, self.take = rank, inbox.send, inbox.take  # the rank's inbox (rank/inbox.py)
        self.post_mortem, self.cell_file = post_mortem, cell_file
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread in pdb now
        self._active = False  # a prompt was sent since the last Resumed

    def ask(self, prompt: Prompt) -> str | None:
        self._active = True
        self.send(prompt)
        answer = self.take(lambda frame: isinstance(frame, Answer))
        return answer.line

    def resumed(self) -> None:
        """The session ended (continue, quit, the cell ran off its end): the kernel is told once."""
        with self._lock:
            self._owner = None
            active, self._active = self._active, False
        if active:
            self.send(Resumed())

    def _enter(self) -> bool:
        with self._lock:
            if self._owner not in (None, threading.get_ident()):
                return False
            self._owner = threading.get_ident()
            return True

    def set_trace(self, frame: FrameType | None = None, header: str = "") -> None:
        """Stop in pdb at the next line of ``frame`` (the caller's by default)."""
        if frame is None:
            frame = _caller()
        if not self._enter():
            return  # another thread of this rank is in pdb
        debugger = CellPdb(self)
        if header:
            debugger.message(header)
        debugger.set_trace(frame)

    def stop_at(self, frame: FrameType) -> None:
        """Stop in pdb now, at ``frame``'s current line (``dist.breakpoint``: the cell's line, before the
        barrier); the person's command then decides what runs (``n`` steps over the barrier)."""
        if not self._enter():
            return
        debugger = CellPdb(self)
        debugger.reset()
        debugger.interaction(frame, None)
        if debugger.continued:
            return
        debugger.trace_from(frame)

    def post_mortem_of(self, error: BaseException) -> None:
        """``%pdb on``: a prompt at the frame that raised, before the rank reports the error."""
        if not self._enter():
            return
        words = f"{type(error).__name__}: {error}"
        debugger = CellPdb(self, post_mortem=words)
        debugger.message(format_cell_traceback(error, self.cell_file).rstrip())
        try:
            debugger.reset()
            debugger.interaction(None, error.__traceback__)
        except bdb.BdbQuit:
            pass
        finally:
            self.resumed()


_link: DebugLink | None = None


def _caller() -> FrameType:
    """The frame that called the function calling this."""
    frame = inspect.currentframe()
    assert frame is not None and frame.f_back is not None and frame.f_back.f_back is not None
    return frame.f_back.f_back


def install(link: DebugLink) -> None:
    """Every way into pdb this rank may take leads to the cell's prompt."""
    global _link
    _link = link
    sys.breakpointhook = _breakpoint
    pdb.set_trace = _set_trace  # the rank's pdb.set_trace is ours from here


def _breakpoint(*args: Any, **kwargs: Any) -> None:
    assert _link is not None
    _link.set_trace(_caller())


def _set_trace(*, header: str | None = None) -> None:
    assert _link is not None
    _link.set_trace(_caller(), header or "")


def cell_ended() -> None:
    """The cell returned or raised: a pdb session that stepped off its end is over."""
    if _link is not None:
        _link.resumed()


def wants_post_mortem(error: BaseException) -> bool:
    """With ``%pdb on``: an exception of the cell (not an interrupt, an exit or pdb's own quit)."""
    return (_link is not None and _link.post_mortem
            and not isinstance(error, (KeyboardInterrupt, SystemExit, bdb.BdbQuit)))


def post_mortem(error: BaseException) -> None:
    assert _link is not None
    _link.post_mortem_of(error)


def distributed_breakpoint(dist: ModuleType) -> None:
    """``torch.distributed.breakpoint(rank=k)``: torch's own semantics (every group's timeout raised,
    the other ranks held in a barrier), with rank k's prompt in the cell instead of ``/dev/stdin``."""
    original = getattr(dist, "breakpoint", None)
    if original is None:  # a torch without distributed support
        return

    passed: dict[tuple[Any, int], int] = {}  # (the caller's code, line) -> calls so far: skip's count

    @functools.wraps(original)
    def breakpoint(rank: int = 0, skip: int = 0, timeout_s: int | None = 3600) -> None:
        caller = _caller()
        place = (caller.f_code, caller.f_lineno)
        passed[place] = passed.get(place, 0) + 1
        if passed[place] <= skip:  # torch's skip: the first `skip` calls of this breakpoint pass (on every rank alike)
            return
        if timeout_s is not None:
            raise_timeouts(datetime.timedelta(seconds=timeout_s))
        if dist.get_rank() == rank and _link is not None:
            _link.stop_at(caller)
        dist.barrier()

    setattr(dist, "breakpoint", breakpoint)  # noqa: B010 - the module is typed without it


# -- holding the other ranks --------------------------------------------------------------------
_kept_timeouts: dict[Any, datetime.timedelta] = {}
_holding = False  # the kernel's last word (Hold): a rank is at a prompt now
_hold_lock = threading.Lock()  # the inbox's reader (on_hold) and the cell's thread (group_made)


def on_hold(frame: Hold) -> None:
    """From the inbox's reader (the cell may be inside a collective): raise or restore every group's timeout.
    A hold that comes while the cell is still making its group (another rank reached its prompt first) is
    kept, and the group gets it once made (:func:`group_made`)."""
    global _holding
    with _hold_lock:
        _holding = frame.on
        if not _initialized():
            return
        if frame.on:
            raise_timeouts(HELD_TIMEOUT)
        else:
            for group, timeout in list(_kept_timeouts.items()):
                _set_timeout(group, timeout)
            _kept_timeouts.clear()


def group_made() -> None:
    """The cell's ``init_process_group`` just returned (rank/groups.py): while a rank is at a prompt, the group is
    held as the others are. Without this, a hold that came during the init found no group to raise, and this
    rank's first collective gave up on the prompted rank after the group's own timeout."""
    with _hold_lock:
        if _holding and _initialized():
            raise_timeouts(HELD_TIMEOUT)


def _initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def raise_timeouts(timeout: datetime.timedelta) -> None:
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    for group in list(c10d._pg_map):  # private API: see taas_magic/private.py
        if group not in _kept_timeouts:
            kept = _timeout_of(group)
            if kept is not None:
                _kept_timeouts[group] = kept
        _set_timeout(group, timeout)


def _set_timeout(group: Any, timeout: datetime.timedelta) -> None:
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    try:
        c10d._set_pg_timeout(timeout, group)  # private API: see taas_magic/private.py
    except (ValueError, RuntimeError, AssertionError):
        pass  # a group this rank is not in, or destroyed meanwhile


def _timeout_of(group: Any) -> datetime.timedelta | None:
    """The group's timeout now (gloo's and NCCL's backends keep it in their options), if it can be read."""
    for device in getattr(group, "_device_types", ()):
        try:
            options = group._get_backend(device).options  # private API: see taas_magic/private.py
            return options._timeout  # private API: see taas_magic/private.py
        except (AttributeError, RuntimeError):
            continue
    return None


# -- %debug after a failure ---------------------------------------------------------------------
def frames_with_locals(error: BaseException, first_file: str) -> list[tuple[str, int, str, dict[str, str]]]:
    """From the cell's first frame down: each frame's place and its locals' reprs (cut), for ``%debug``."""
    tb: TracebackType | None = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != first_file:
        tb = tb.tb_next
    tb = tb or error.__traceback__
    frames = []
    while tb is not None:
        frame = tb.tb_frame
        names: dict[str, str] = {}
        for name, value in list(frame.f_locals.items()):
            if len(names) == LOCALS_SHOWN:
                break
            at_module = frame.f_code.co_name == "<module>"  # the cell's globals: its own values, not what it imported
            if at_module and (name.startswith("_") or isinstance(value, ModuleType) or callable(value)):
                continue
            names[name] = _short_repr(value)
        frames.append((cell_label(frame.f_code.co_filename), tb.tb_lineno, frame.f_code.co_name, names))
        tb = tb.tb_next
    return frames


def _short_repr(value: object) -> str:
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a repr that raises is shown as such
        text = f"<repr raised {type(exc).__name__}>"
    return text if len(text) <= REPR_CHARS else text[: REPR_CHARS - 3] + "..."
