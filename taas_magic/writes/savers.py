"""In a rank: the saves in which every rank writes its own part, recognised from the save itself.

Runs in each rank: installed on its main thread before the cell, its hooks on whichever thread of
the cell saves.

The write rule keeps a rank other than 0 from writing to the repository, because unguarded code
written for one process (``torch.save(model.state_dict(), "m.pt")`` on every rank) would race. A
collective checkpoint is the opposite case: each rank must write its own part, or the checkpoint
cannot be loaded. So the saves below, on every rank, first name their folder: the folder is
written in place from then on by that rank (writes/shared.py), and the kernel is told
(``CheckpointSaved``), to check the folder once the ranks are gone (writes/completeness.py).
Every other write of the run stays diverted.

Recognised, each from the call that saves (the folder is the save's own argument, never a guess
from file names):

- ``torch.distributed.checkpoint``: every ``FileSystemWriter`` (so every ``dcp.save``,
  ``save_state_dict``, the thread executor of ``async_save``, the Hugging Face storage writer with
  its consolidated folder, Lightning's sharded checkpoints, torchtitan) as it plans its local part;
  ``async_save`` itself too, before its process executor's child writes (the child shares the
  rank's mount namespace). A pending ``async_save`` is waited for before the rank ends
  (:func:`finish`), so a cell that ends right after one still leaves a whole checkpoint.
- accelerate's ``Accelerator.save_state`` (its per-process ``random_states_{i}.pkl``), where it
  calls ``save_accelerator_state``.
- the HF ``Trainer``'s checkpoints (``rng_state_{i}.pth``), where it saves its RNG state.
- ``taas.shared(path)``, and the pragma's ``--shared DIR``: a saver nobody recognised.

Rank 0 writes in place already; it names its folders all the same, so the kernel checks them.
Code runs on the thread that saves (DCP's thread executor: its thread), or the cell's.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

from taas_magic.import_hooks import when_imported
from taas_magic.protocol import ToKernel
from taas_magic.writes import shared


# -- this feature's frames (protocol.py frames them, and lists every frame) --------------------
@dataclass(frozen=True)
class CheckpointSaved(ToKernel, kind="checkpoint"):
    """A rank began a collective save into ``folder`` (writes/savers.py), checked at the end (writes/completeness.py)."""

    folder: str  # absolute, as the rank sees it (under the repository)
    saver: str  # who saves: "torch.distributed.checkpoint", "accelerate save_state", ...
    layout: str  # "dcp": a .metadata lists its parts; "files": per-rank files only


DCP = "torch.distributed.checkpoint"
DCP_LAYOUT, FILES_LAYOUT = "dcp", "files"

_send: Callable[[ToKernel], None] | None = None
_told: set[tuple[str, str]] = set()
_pending: list[Any] = []  # async_save's futures, waited for by finish()
_lock = threading.Lock()


def install(send: Callable[[ToKernel], None], folders: tuple[str, ...] = ()) -> None:
    """Recognise the savers from now on, telling the kernel through ``send``; share ``folders`` now (``--shared``)."""
    global _send
    first, _send = _send is None, send
    for folder in folders:
        _share_quietly(folder, "--shared", FILES_LAYOUT)
    if not first:
        return  # a kept rank's next cell: the savers are recognised already
    when_imported("torch.distributed.checkpoint", _patch_dcp)
    when_imported("accelerate.accelerator", _patch_accelerate)
    when_imported("transformers.trainer", _patch_trainer)


def share(folder: str | os.PathLike, saver: str, layout: str = FILES_LAYOUT) -> str:
    """Make ``folder`` written in place by this rank, and tell the kernel; returns it, absolute.

    Raises:
        shared.ShareRefused: the rank could not write it in place (the message says why).
    """
    absolute = os.path.abspath(os.fsdecode(os.fspath(folder)))
    shared.share(absolute)
    with _lock:
        first = (absolute, layout) not in _told
        _told.add((absolute, layout))
    if first and _send is not None:
        _send(CheckpointSaved(absolute, saver, layout))
    return absolute


def _share_quietly(folder: Any, saver: str, layout: str) -> None:
    """A recognised save names its folder; if the folder cannot be shared, the save goes on (the
    kernel then names the parts it lacks) and the rank says why once, on stderr."""
    try:
        share(folder, saver, layout)
    except (OSError, TypeError) as exc:
        print(f"taas: {saver} into {folder}: this rank's part could not be written in place ({exc}); "
              "it stays in the rank's private layer", file=sys.stderr, flush=True)


def finish() -> None:
    """The cell ended: wait for this rank's pending ``async_save`` calls, so their parts are whole."""
    with _lock:
        pending, _pending[:] = list(_pending), []
    waiting = [future for future in pending if not future.done()]
    if waiting:
        print(f"taas: waiting for {len(waiting)} async checkpoint save(s) to finish", file=sys.stderr, flush=True)
    for future in pending:
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - the cell already ended; the kernel's check names what is missing
            print(f"taas: an async checkpoint save failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


# -- torch.distributed.checkpoint -----------------------------------------------------------------
def _writer_folder(writer: Any) -> Any:
    """The folder a FileSystemWriter writes: the Hugging Face writer's consolidated folder holds its parts."""
    return getattr(writer, "consolidated_output_path", None) or writer.path


def _layout(writer: Any) -> str:
    return FILES_LAYOUT if getattr(writer, "consolidated_output_path", None) else DCP_LAYOUT


def _patch_dcp(module: ModuleType) -> None:
    from torch.distributed.checkpoint import filesystem, state_dict_saver

    writer_class = filesystem.FileSystemWriter
    plan = writer_class.prepare_local_plan

    @functools.wraps(plan)
    def prepare_local_plan(self: Any, *args: Any, **kwargs: Any) -> Any:
        _share_quietly(_writer_folder(self), DCP, _layout(self))
        return plan(self, *args, **kwargs)

    writer_class.prepare_local_plan = prepare_local_plan  # type: ignore[method-assign]  # wrapped: the point
    async_save = state_dict_saver.async_save

    @functools.wraps(async_save)
    def recognised_async_save(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        checkpoint_id = kwargs.get("checkpoint_id", args[0] if args else None)
        writer = kwargs.get("storage_writer", args[1] if len(args) > 1 else None)
        if isinstance(writer, filesystem.FileSystemWriter):
            _share_quietly(_writer_folder(writer) if checkpoint_id is None else checkpoint_id, DCP, _layout(writer))
        elif writer is None and checkpoint_id is not None and filesystem.FileSystemWriter.validate_checkpoint_id(checkpoint_id):
            _share_quietly(checkpoint_id, DCP, DCP_LAYOUT)
        response = async_save(state_dict, *args, **kwargs)
        with _lock:
            _pending.append(getattr(response, "upload_completion", response))
        return response

    state_dict_saver.async_save = recognised_async_save
    module.async_save = recognised_async_save  # type: ignore[attr-defined]  # the package's re-export, wrapped too


# -- accelerate and the HF Trainer ----------------------------------------------------------------
def _patch_accelerate(module: ModuleType) -> None:
    save_state = getattr(module, "save_accelerator_state", None)  # undocumented: see taas_magic/private.py
    if save_state is None:
        return

    @functools.wraps(save_state)
    def save_accelerator_state(output_dir: Any, *args: Any, **kwargs: Any) -> Any:
        _share_quietly(output_dir, "accelerate save_state", FILES_LAYOUT)
        return save_state(output_dir, *args, **kwargs)

    module.save_accelerator_state = save_accelerator_state  # type: ignore[attr-defined]  # what save_state calls


def _patch_trainer(module: ModuleType) -> None:
    trainer = getattr(module, "Trainer", None)
    save_rng = getattr(trainer, "_save_rng_state", None)  # private API: see taas_magic/private.py
    if trainer is None or save_rng is None:
        return

    @functools.wraps(save_rng)
    def _save_rng_state(self: Any, output_dir: Any, *args: Any, **kwargs: Any) -> Any:
        _share_quietly(output_dir, "transformers Trainer", FILES_LAYOUT)
        return save_rng(self, output_dir, *args, **kwargs)

    trainer._save_rng_state = _save_rng_state  # private API: see taas_magic/private.py
