"""The session's compile cache, the rank's half: torch's portable cache artifacts, saved and loaded.

Runs in the rank, on its main thread. ``torch.compiler.save_cache_artifacts()`` serialises what
this process compiled or found in the caches (Inductor's FX graphs, AOTAutograd's entries,
autotuning, Dynamo's profiles of dynamic shapes and, with ``TORCH_CACHING_PRECOMPILE=1``, its
precompiled frames, which only this call writes to disk); ``torch.compiler.load_cache_artifacts(bytes)``
writes them into the caches of another process before it compiles.

- :func:`save`, after a cell that ran to its end: only where the cell imported Dynamo, and only when
  torch has artifacts to give, and only when they differ from what this process saved last (a kept
  rank's cells after the one that compiled write nothing); written to a temporary name, then
  renamed, so a rank never reads half a file.
- :func:`load_when_compiling`, before the cell: only where this rank's Inductor caches are not the
  session's folder (the person's own ``TORCHINDUCTOR_CACHE_DIR`` won: folder.py), since the
  session's folder already holds every entry the artifacts carry, and loading them again would cost
  every later cell that imports Dynamo (``DistributedDataParallel`` does) about 0.2 s for nothing.
  There, rank K's artifacts are loaded once the cell first imports ``torch._dynamo``, so a cell that
  never does pays nothing.

Neither ever fails the cell: a failure is one line on stderr, once per rank, and the cell compiles
as it would have without.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

from taas_magic.compilecache.folder import ARTIFACTS, INDUCTOR
from taas_magic.import_hooks import when_imported

_warned = False
_saved: bytes | None = None  # what this process saved last: a kept rank's later cells that compiled nothing write nothing


def artifact_file(folder: str, rank: int) -> str:
    return os.path.join(folder, ARTIFACTS, f"rank-{rank}.bin")


def _warn(what: str, why: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"taas: the session's compile cache could not be {what} ({why}); this rank goes on without it",
              file=sys.stderr, flush=True)


def load_when_compiling(folder: str, rank: int) -> None:
    """Load rank ``rank``'s artifacts in ``folder`` once the cell imports Dynamo (now, if it already has),
    unless this rank's Inductor caches are that folder's already."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") == os.path.join(folder, INDUCTOR):
        return

    def load_now(_dynamo: ModuleType) -> None:
        load(folder, rank)

    when_imported("torch._dynamo", load_now)


def load(folder: str, rank: int) -> bool:
    """Whether rank ``rank``'s artifacts were there and loaded."""
    path = artifact_file(folder, rank)
    if not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as saved:
            data = saved.read()
        import torch.compiler

        loaded = torch.compiler.load_cache_artifacts(data)
    except Exception as exc:  # noqa: BLE001 - the cell compiles without them
        _warn("loaded", f"{type(exc).__name__}: {exc}")
        return False
    if loaded is None:  # torch could not read them (another torch's, or damaged): it said why on its log
        _warn("loaded", f"torch could not read {path}")
        return False
    return True


def save(folder: str, rank: int) -> bool:
    """Whether this rank's artifacts were saved: only after a cell that imported Dynamo and compiled."""
    if "torch._dynamo" not in sys.modules:
        return False  # the cell never reached torch.compile: nothing to save, and torch's compiler stays unloaded
    path = artifact_file(folder, rank)
    try:
        import torch.compiler

        saved = torch.compiler.save_cache_artifacts()
        if saved is None or (saved[0] == _saved and os.path.isfile(path)):  # nothing new since this process saved
            return False
        _write_whole(path, saved[0])
        _remember(saved[0])
    except Exception as exc:  # noqa: BLE001 - the cell's results matter more than the cache
        _warn("saved", f"{type(exc).__name__}: {exc}")
        return False
    return True


def _remember(data: bytes) -> None:
    global _saved
    _saved = data


def _write_whole(path: str, data: bytes) -> None:
    """``data`` at ``path``, owner-only, appearing whole or not at all (a temporary name, then a rename)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    try:
        descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(data)
        os.replace(partial, path)
    except BaseException:
        try:
            os.unlink(partial)
        except OSError:
            pass
        raise
