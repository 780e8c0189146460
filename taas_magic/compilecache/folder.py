"""The session's compile cache, the kernel's half: one owner-only folder, and each rank's variables.

Runs in the kernel. :class:`CompileCache` makes the folder the first time a cell asks for it
(``<spill root>/taas-compile-<kernel pid>-XXXX``, ``$TAAS_SPILL_DIR`` or the temp dir; mode 0700, so
no other user can plant a pickle that a rank would load), and removes it when the extension unloads (the magic's ``close``) or
the kernel exits (``atexit``); one a killed kernel left is swept by the next kernel that makes one
(tempdirs.py). Inside it::

    inductor/    TORCHINDUCTOR_CACHE_DIR: Inductor's FX graph cache, AOTAutograd's cache, the built kernels
    triton/      TRITON_CACHE_DIR (GPU kernels)
    artifacts/   rank-K.bin: torch's portable cache artifacts of rank K's last compiled cell (artifacts.py)

:func:`point_ranks` adds each rank's variables (torch reads ``TORCHINDUCTOR_CACHE_DIR`` each time
it needs the folder, and the FX graph and AOTAutograd switches when Inductor's and functorch's
config modules are first imported, which a warm spare has not done: so a spare that adopts the
launch's environment, rank/spare.py, uses the folder too). A variable the person set in the
kernel's environment is left as it is, except ``TORCHINDUCTOR_CACHE_DIR`` naming torch's own
per-user folder: torch writes that into the environment of any process that imports Dynamo (the
kernel does, when a compiled cell's names come back), so it is torch's default, not a choice.
"""

from __future__ import annotations

import atexit
import getpass
import os
import re
import tempfile

from taas_magic.tempdirs import remove_tree, spill_root, sweep_orphans

PREFIX = "taas-compile-"
INDUCTOR, TRITON, ARTIFACTS = "inductor", "triton", "artifacts"


def rank_variables(folder: str) -> dict[str, str]:
    """The variables that point a rank's compile caches into ``folder``, the caches on."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, INDUCTOR),
        "TRITON_CACHE_DIR": os.path.join(folder, TRITON),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }


def torch_default_folder() -> str:
    """torch's own per-user cache folder, ``<temp dir>/torchinductor_<user>`` (its documented default,
    torch/_inductor/runtime/cache_dir_utils.py), which it writes into the environment when it first uses it."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.abspath(os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)))


def point_ranks(env: dict[str, str], folder: str) -> None:
    """``env`` (a rank's: the kernel's environment and torchrun's variables) with the compile caches in
    ``folder``, each variable only where the person did not set it."""
    if env.get("TORCHINDUCTOR_CACHE_DIR") == torch_default_folder():
        del env["TORCHINDUCTOR_CACHE_DIR"]  # torch put it there, not the person (see above)
    for name, value in rank_variables(folder).items():
        env.setdefault(name, value)


class CompileCache:
    """The session's folder: made on first use, owner-only, gone at :meth:`close` or the kernel's exit."""

    def __init__(self, root: str | None = None) -> None:
        self._root = root  # where the folder goes (default: taas's spill root, tempdirs.py)
        self.path: str | None = None
        self._at_exit = False

    def folder(self) -> str:
        """The folder, made now if there is none (or it was removed under us)."""
        if self.path is None or not os.path.isdir(self.path):
            root = self._root or spill_root()
            sweep_orphans(root, PREFIX)  # what a killed kernel left
            self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)  # 0700
            if not self._at_exit:
                atexit.register(self.close)
                self._at_exit = True
        return self.path

    def compiled(self) -> bool:
        """Whether a rank compiled with the folder: Inductor wrote its caches there, or a rank its artifacts."""
        return self.path is not None and any(_has_entries(os.path.join(self.path, part)) for part in (INDUCTOR, ARTIFACTS))

    def close(self) -> None:
        """Remove the folder (the extension unloads, or the kernel exits); a later cell makes a new one."""
        path, self.path = self.path, None
        if path is not None and os.path.isdir(path):
            remove_tree(path)


def _has_entries(path: str) -> bool:
    try:
        with os.scandir(path) as entries:
            return any(True for _ in entries)
    except OSError:
        return False
