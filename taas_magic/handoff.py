"""How the pickled closure reaches the ranks: in a frame, or (when large) one shared file.

The closure is pickled once. Below ``HANDOFF_BYTES`` it travels in the ``closure`` frame
of each rank's channel. Above, the kernel writes it once to an owner-only file in
``/dev/shm`` (memory, not disk) and sends each rank only ``{path, size, sha256}`` in an
authenticated ``closure-file`` frame. A rank maps the file and checks its SHA-256
against the digest the key vouched for before unpickling anything, so no rank copies
the closure through a socket and the transport rule still holds: nothing is unpickled
that a peer holding the key did not vouch for. The file is removed when the cell ends,
and swept by a later run if the kernel was killed first.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import tempfile
from typing import IO

from . import wire
from .isolation import sweep_orphans
from .feed.segments import ram_root

HANDOFF_BYTES = 4 << 20
PREFIX = "taas-closure-"


class ClosureHandoff:
    """The kernel's side: the frame body to send each rank, and the file to remove."""

    def __init__(self, blob: bytes, run_id: str, threshold: int = HANDOFF_BYTES):
        self.path: str | None = None
        if len(blob) < threshold:
            self.body = wire.encode_body("closure", blob)
            return
        directory = ram_root()
        sweep_orphans(directory, PREFIX)
        fd, self.path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-{run_id}-", dir=directory)  # 0600
        with os.fdopen(fd, "wb") as handle:
            handle.write(blob)
        digest = hashlib.sha256(blob).hexdigest()
        self.body = wire.encode_body("closure-file", wire.dumps({"path": self.path, "size": len(blob), "sha256": digest}))

    def remove(self) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self.path = None


def receive_closure(channel: wire.BlockingChannel) -> IO[bytes]:
    """The rank's side: the closure's bytes as a file to unpickle from (no copy for a file)."""
    kind, body = channel.recv()
    if kind == "closure":
        return io.BytesIO(body)
    if kind != "closure-file":
        raise ConnectionError(f"expected the closure from the kernel, got a {kind!r} frame")
    info = wire.loads_verified(body)
    with open(info["path"], "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), info["size"], access=mmap.ACCESS_READ)
    if hashlib.sha256(mapped).hexdigest() != info["sha256"]:
        mapped.close()
        raise wire.AuthenticationError(f"the closure file {info['path']} does not match the digest the kernel sent")
    return mapped  # type: ignore[return-value]  # mmap has read()/readline(), all pickle needs
