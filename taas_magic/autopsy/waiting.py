"""The rank's half of the hang line: how long its cell has waited in one call into ``torch.distributed``.

Runs in each rank, on the reports thread (output/reports.py measures it with the rest of the rank's health,
about every 2 s, and the kernel's half, autopsy/hangline.py, reads it there).

The cell runs on the rank's main thread. :func:`waited` looks at that thread's innermost Python frame
(``sys._current_frames``: a dictionary lookup, no signal, nothing the cell feels): when it is in
``torch.distributed``'s own code (a collective, a barrier, a ``work.wait()`` of FSDP or DCP, the object
collectives), and it is the very frame, at the very instruction, that the last look found there, the cell
has been waiting in that one call since then. A loop that calls ``all_reduce`` again and again is a new frame
each time, never a wait: the frame seen is held (a reference, until the next look finds another), so no new
call can take its address. What it cannot see: a wait below Python that no frame of ``torch.distributed``
is on (DDP's gradient all-reduce inside ``backward()``: the frame there is autograd's); a rank whose GIL is
held by C code does not answer at all (its health stops, which the kernel's half treats as still waiting).
"""

from __future__ import annotations

import os
import sys
import threading
from types import FrameType

_DIST = os.sep + os.path.join("torch", "distributed") + os.sep

_frame: FrameType | None = None  # the innermost frame seen waiting last time (held: see the docstring)
_instruction = -1
_since = 0.0


def waited(now: float) -> float:
    """Seconds the main thread has been in one call into ``torch.distributed`` as of ``now`` (0: it is not)."""
    global _frame, _instruction, _since
    frame = sys._current_frames().get(threading.main_thread().ident or 0)  # private API: see taas_magic/private.py
    if frame is None or _DIST not in frame.f_code.co_filename:
        _frame = None
        return 0.0
    if frame is not _frame or frame.f_lasti != _instruction:
        _frame, _instruction, _since = frame, frame.f_lasti, now
        return 0.0
    return now - _since


def figures(now: float, away: bool = False) -> dict:
    """What the rank's health carries for the hang line: its wait, and whether its host does not see the
    notebook's repository (``away``: then what rank 0 writes is not there, which the line says)."""
    return {"waiting": waited(now), **({"away": True} if away else {})}
