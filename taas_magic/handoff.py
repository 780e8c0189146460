"""How the closure reaches the ranks: its pickle in the frame, its tensor bytes in one shared map.

The kernel pickles the closure once (transfer/pack.py) and writes the tensor and array
bytes once (transfer/memfile.py): below ``HANDOFF_BYTES`` inside the ``closure`` frame,
above it to one owner-only file in ``/dev/shm`` that every rank maps copy-on-write, so a
rank that changes a captured tensor in place changes only its own pages, and the pages
it only reads exist once for all ranks. The authenticated frame carries the pickle, the
blobs' places, one digest per name (what rank 0 compares against to see whether a
shipped value changed in place) and a digest per chunk of the file, which a rank checks
before it builds anything on those bytes.

The kernel keeps its :class:`~taas_magic.transfer.pack.Packing` until the cell's results
are in: rank 0 refers to a shipped blob whose bytes it did not change, and the kernel
resolves that to its own storage. The file is removed when the cell ends and swept by a
later run if the kernel was killed first.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from . import wire
from .transfer import memfile, unpack
from .transfer.pack import Packing

HANDOFF_BYTES = memfile.INLINE_BYTES


def segment_digests(packing: Packing) -> dict[str, bytes]:
    """SHA-256 of each name's segment of the pickle."""
    digests, start = {}, 0
    for segment in packing.segments:
        digests[segment.name] = hashlib.sha256(packing.skeleton[start:segment.end]).digest()
        start = segment.end
    return digests


class ClosureHandoff:
    """The kernel's side: the frame body to send each rank, and the file to remove."""

    def __init__(self, packing: Packing, run_id: str, threshold: int = HANDOFF_BYTES):
        self.packing = packing
        self.data = memfile.write(packing.blobs, memfile.CLOSURE_PREFIX, os.getpid(), run_id, threshold)
        self.path = self.data.path
        message = {"skeleton": packing.skeleton, "segments": packing.segments, "digests": segment_digests(packing),
                   "kinds": [blob.kind for blob in packing.blobs], "data": self.data}
        self.body = wire.encode_body("closure", wire.dumps(message))

    def remove(self) -> None:
        memfile.remove(self.path)
        self.path = None


@dataclass
class ReceivedClosure:
    """The rank's side: what the kernel shipped, mapped and verified, ready to load."""

    message: dict
    buffer: Any  # the mapped file (copy-on-write) or the frame's bytes
    pristine: bytes = b""  # a copy of small inline data, taken before the cell runs

    @property
    def data(self) -> memfile.BlobData:
        return self.message["data"]

    @property
    def names(self) -> list[str]:
        return [segment.name for segment in self.message["segments"]]

    def load(self, externals: Callable[[int], Any]) -> dict[str, Any]:
        """The closure's values by name (registered loaders resolved through ``externals``).

        Raises:
            pickle.UnpicklingError or whatever a value's unpickling raises, for the first name that fails.
        """
        places = [("at", offset, size) for offset, size in zip(self.data.offsets, self.data.sizes)]
        resolve = unpack.resolver(unpack.Blobs(places, self.buffer), externals)
        values, failed = unpack.load(self.message["skeleton"], self.message["segments"], resolve)
        if failed:
            name, type_name, reason = failed[0]
            raise RuntimeError(f"{name} ({type_name}) could not be loaded in the rank: {reason}")
        return values

    def base_address(self) -> int:
        """Where the blob bytes start in this process (0 when there are none)."""
        if not self.data.size:
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))

    def original_bytes(self) -> Any:
        """The bytes as the kernel sent them, before the cell changed any in place."""
        if self.data.path is None:
            return self.pristine
        return memfile.original_view(self.data)


def receive_closure(channel: wire.BlockingChannel, keep_original: bool = False) -> ReceivedClosure:
    """Read the closure frame and map (and verify) its tensor bytes; nothing is unpickled yet.

    ``keep_original`` (rank 0): keep a copy of bytes that came in the frame, to tell later
    which the cell changed (a file's original stays in the file).

    Raises:
        wire.AuthenticationError: the file's bytes are not those the kernel vouched for.
    """
    kind, body = channel.recv()
    if kind != "closure":
        raise ConnectionError(f"expected the closure from the kernel, got a {kind!r} frame")
    message = wire.loads_verified(body)
    received = ReceivedClosure(message, memfile.open_data(message["data"], private=True))
    if keep_original and message["data"].path is None:
        received.pristine = bytes(received.buffer)
    return received
