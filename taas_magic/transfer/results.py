"""Rank 0's names -> the notebook namespace; its final expression -> the cell's ``Out``.

Runs in the kernel: :func:`keep_result` on the run's own thread as the ``Result`` frame arrives; the
names bound on the cell's thread that takes the run (kernel/runs/background.py).

The ``Result`` frame (authenticated) holds the pickle's segments, where each tensor's
bytes are, and the digests of the memory file rank 0 wrote (transfer/returns.py). The
kernel maps that file shared, checks it, removes its name at once (the mapping keeps
the pages, which are then the only copy) and builds every tensor on it. A tensor
rank 0 left untouched is built on the kernel's own storage instead.

Each name is loaded on its own (transfer/unpack.py): one that cannot be pickled in
rank 0 or loaded here costs only itself, and one line lists each with its type and
why. A wrapper that came back as its module is said in a line of its own.

CUDA storages rank 0 sent as CUDA IPC handles (transfer/cudaipc.py) are copied into
storages of the kernel's own when the ``Result`` frame arrives, while rank 0 waits with
them alive (:func:`keep_result`, called by the supervisor); the copies take the handles'
places in the kernel's copy of the frame as ``("made", k)``, and rank 0 is told ``Released``.
If they cannot be copied, nothing of them is kept and rank 0 is told ``SendHost``: it sends
the result again with those bytes in the memory file. One line says which way the CUDA
tensors came back.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Sequence

from taas_magic import protocol
from taas_magic.transfer import cudaipc, memfile, unpack
from taas_magic.transfer.pack import Packing
from taas_magic.transfer.returns import Released, Result, SendHost
from taas_magic.wire import AuthenticationError


def _short(type_name: str) -> str:
    return type_name.rsplit(".", 1)[-1]


def _label(name: str) -> str:
    return "the final value" if name == unpack.FINAL else name


def report(failed: Sequence[tuple[str, str, str]], notes: Sequence[tuple[str, str, str]]) -> None:
    """One line for what did not come back (a warning: stderr), one for what came back as something else
    (information: stdout, which Jupyter does not paint as an error)."""
    if failed:
        listed = ", ".join(f"{_label(name)} ({type_name}: {reason})" for name, type_name, reason in failed)
        noun = "name" if len(failed) == 1 else "names"
        print(f"taas: {len(failed)} {noun} could not come back from rank 0 (the notebook keeps what it had): {listed}",
              file=sys.stderr)
    if notes:
        print("taas: " + "; ".join(f"{_label(name)}: {_short(type_name)}, {note}" for name, type_name, note in notes))


def take_device_copies(message: Result) -> tuple[bytes, Result | None] | None:
    """Kernel, as rank 0's ``Result`` frame arrives: copy the CUDA storages it exported.

    Returns None when it exported none; else the frame to send rank 0 and the result made whole
    with the copies (rank 0 is told ``Released``), or None: it must wait for the result sent
    again through host memory (rank 0 is told ``SendHost``).
    """
    if not message.ipc:
        return None
    try:
        made = cudaipc.take(message.ipc)
    except Exception as exc:  # noqa: BLE001 - any IPC or CUDA error: the bytes come through host memory
        return protocol.encode(SendHost(cudaipc.describe(exc))), None
    places = [("made", place[1]) if place is not None and place[0] == "ipc" else place for place in message.places]
    whole = dataclasses.replace(message, places=places, made=tuple(made), ipc=[],
                                cuda_ipc=(len(made), sum(storage.nbytes() for storage in made)))
    return protocol.encode(Released()), whole


def keep_result(message: Result) -> tuple[Result | None, bytes | None]:
    """Rank 0's result as it arrives: the result to keep (None: wait for it to come again through
    host memory), and the frame to answer rank 0 with (None: it waits for nothing)."""
    taken = take_device_copies(message)
    if taken is None:
        return message, None
    reply, whole = taken
    return whole, reply


def cuda_line(message: Result) -> str | None:
    """How rank 0's CUDA tensors came back, in one line (None when none did)."""
    parts = []
    count, nbytes = message.cuda_ipc
    if count:
        parts.append(f"{count} CUDA tensor(s), {cudaipc.size_text(nbytes)}, came back device to device (CUDA IPC)")
    count, nbytes, why = message.cuda_host
    if count:
        why = why or cudaipc.unavailable() or "the ranks share no memory with the kernel"
        parts.append(f"{count} CUDA tensor(s), {cudaipc.size_text(nbytes)}, came back through host memory ({why})")
    return "taas: " + "; ".join(parts) if parts else None


def apply_results(user_ns: dict[str, Any], message: Result | None, shipped: Packing | None = None,
                  externals: Sequence[Any] = ()) -> Any:
    """Bind what rank 0 sent back; return its final value (or None).

    ``shipped`` is the closure the kernel sent (rank 0 refers to its untouched tensors);
    ``externals`` the registered loaders, by index.
    """
    if message is None:
        return None
    line = cuda_line(message)  # before anything here initialises CUDA (the reason may be that it was not)
    if line is not None:  # device to device is information; a fall-back through host memory, a warning
        print(line, file=sys.stderr if message.cuda_host[0] else sys.stdout)
    data = message.data
    try:
        buffer = memfile.open_data(data, private=False)
    except (AuthenticationError, OSError) as exc:
        print(f"taas: rank 0's results were not loaded: {exc}", file=sys.stderr)
        return None
    finally:
        memfile.remove(data.path)  # mapped (or refused): the name is no longer needed
    blobs = unpack.Blobs(message.places, buffer, shipped.blobs if shipped is not None else (), message.made)
    values, failed = unpack.load(message.skeleton, message.segments, unpack.resolver(blobs, externals.__getitem__))
    bound = [segment for segment in message.segments if segment.bind and segment.name in values]
    for segment in bound:
        if segment.name != unpack.FINAL:
            user_ns[segment.name] = values[segment.name]
    for name in message.deleted:
        user_ns.pop(name, None)
    report(list(message.failed) + failed, [(s.name, s.type_name, s.note) for s in bound if s.note])
    return values.get(unpack.FINAL)
