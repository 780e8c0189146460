"""An exported job's runtime: its ranks started, each rank set up as a taas rank is, rank 0's names saved.

Runs in the job: the script ``%taas export`` wrote (export/files.py) calls :func:`start` first thing, and
:meth:`Job.finish` last. Needs torch and this package's runtime, never IPython, ipykernel or jupyter_client.

:func:`start`, by what launched the script:

- ``torchrun`` (``RANK`` set), or Slurm's ``srun`` (``SLURM_PROCID`` set: the ranks' environment made from Slurm's
  variables, as the Slurm engine does): this process is one rank; :func:`start` sets it up and returns its
  :class:`Job`.
- ``python SCRIPT``: this process runs the job's ranks through torch's own elastic launcher (``torchrun``'s:
  a loopback rendezvous, every rank started again up to ``restarts`` times when one fails), shows rank 0's output
  (the others' go to the job folder's ``logs/``), stops them all after ``timeout`` seconds, and exits with the
  job's status: :func:`start` never returns there.

Each rank, as a taas rank: on ``device="cpu"`` it sees no GPU and ``nccl`` is served by gloo; on ``"cuda"`` its GPU is
``LOCAL_RANK``'s; ranks other than 0 write under the repository (the git work tree around the working
directory, as the notebook's rule finds it) into a private layer that is thrown away, overlay where the
host allows it, else by Python: only rank 0's files land, except in the ``shared`` folders, where every rank
writes in place. :meth:`Job.finish` has rank 0 save the names the cell bound (a DDP or compiled wrapper as
its module) to the job folder's ``results.pt``, which ``taas.load_job(SCRIPT)`` binds in a notebook.
"""

from __future__ import annotations

import atexit
import io
import os
import sys
import tempfile
import types
from dataclasses import dataclass, field
from typing import Any

from taas_magic.export import launcher
from taas_magic.export.jobfeed import JobFeed, job_feed
from taas_magic.feed.plan import FeedTerms

RESULTS = "results.pt"
VALUES = "values.pt"
_UNBOUND = object()  # a name the script did not hold before the cell


def job_folder(script: str) -> str:
    """The folder beside ``script`` that holds its values, its results and its ranks' logs."""
    stem, _ = os.path.splitext(os.path.abspath(script))
    return stem + ".taas"


@dataclass
class Job:
    """One rank of a job (see the module docstring)."""

    script: str
    rank: int
    world: int
    before: dict[str, object] = field(default_factory=dict)  # the script's globals before the cell

    def values(self, *names: str) -> Any:
        """The notebook values the cell reads, saved beside the script, in the order named (a tuple, one or more)."""
        import torch

        saved = torch.load(os.path.join(job_folder(self.script), VALUES), weights_only=False)
        return tuple(saved[name] for name in names)

    def feed(self, loader: Any, *, cpus: int = 1, units: int | None = None, seed: int = 0, name: str = "") -> JobFeed:
        """A registered loader as this rank sees it under taas's data workers: its share of each pass (``name``: the
        notebook's name for it, which a refusal says, as a cell's does)."""
        return job_feed(loader, self.rank, FeedTerms(units, self.world, cpus // self.world, seed, ahead=1), name)

    def begin_cell(self, namespace: dict) -> None:
        """What the script's globals hold before the cell: :meth:`finish` saves only what the cell bound."""
        self.before = dict(namespace)  # the objects, held: an id alone can be reused by what the cell binds

    def finish(self, namespace: dict) -> None:
        """Rank 0: the names the cell bound, saved for ``taas.load_job`` (each on its own: one that cannot be saved,
        a sharded module say, costs only itself and is named); every rank: done."""
        if self.rank != 0:
            return
        import torch

        from taas_magic.transfer.unwrap import unwrap

        results, left = {}, []
        for name, value in namespace.items():
            if name.startswith("_") or self.before.get(name, _UNBOUND) is value or isinstance(value, types.ModuleType):
                continue
            buffer = io.BytesIO()
            try:
                unwrapped = unwrap(value) if isinstance(value, torch.nn.Module) else None  # DDP, compiled: the module
                torch.save(unwrapped[0] if unwrapped is not None else value, buffer)
            except Exception as exc:  # noqa: BLE001 - a name that cannot be saved costs only itself
                left.append(f"{name} ({type(exc).__name__})")
                continue
            results[name] = buffer.getvalue()
        torch.save(results, os.path.join(job_folder(self.script), RESULTS))
        if left:
            print(f"taas: not saved for the notebook: {', '.join(left)}", file=sys.stderr)


def load_results(script: str) -> dict[str, Any]:
    """Rank 0's names from the job's last run (its ``results.pt``), for ``taas.load_job``.

    Raises:
        FileNotFoundError: the job has not finished a run since it was exported.
        PermissionError: the job's folder is not this user's own, or others may write to it (it is unpickled).
    """
    import torch

    folder, results = job_folder(script), os.path.join(job_folder(script), RESULTS)
    if not os.path.exists(results):
        raise FileNotFoundError(f"taas: {script} has no results yet ({results}): run it, then load it")
    for checked in (folder, results):
        status = os.stat(checked)
        if status.st_uid != os.getuid() or status.st_mode & 0o022:
            raise PermissionError(f"taas: {checked} is not yours alone (its owner or mode): not unpickled")
    saved = torch.load(results, weights_only=False)
    return {name: torch.load(io.BytesIO(data), weights_only=False) for name, data in saved.items()}


def start(script: str, *, ranks: int, device: str = "cpu", restarts: int = 0, timeout: float | None = None,
          shared: tuple[str, ...] = ()) -> Job:
    """This rank's :class:`Job`, or, launched as ``python SCRIPT``, the whole job run and this process exited."""
    os.makedirs(job_folder(script), mode=0o700, exist_ok=True)
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        launcher.rank_from_slurm()
    if "RANK" not in os.environ:
        sys.exit(launcher.run_elastic(script, ranks, restarts, timeout, job_folder(script)))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != ranks:
        print(f"taas: this job was exported for {ranks} rank(s) and runs as {world}", file=sys.stderr)
    _set_up_rank(rank, device, shared)
    return Job(os.path.abspath(script), rank, world)


def _set_up_rank(rank: int, device: str, shared: tuple[str, ...]) -> None:
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        from taas_magic.import_hooks import when_imported
        from taas_magic.rank.devices import serve_nccl_with_gloo

        when_imported("torch.distributed", serve_nccl_with_gloo)
    elif device == "cuda":
        from taas_magic.import_hooks import when_imported
        from taas_magic.rank.devices import bind_gpu

        when_imported("torch", lambda _: bind_gpu())
    from taas_magic.writes import savers
    from taas_magic.writes.rule import find_repository

    repository = find_repository(os.getcwd())
    if rank != 0:
        _divert_writes(repository)
    # collective checkpoints (DCP, accelerate's save_state, ...) and --shared: every rank's part in place
    savers.install(lambda _frame: None, tuple(os.path.join(repository, folder) for folder in shared))


def _divert_writes(repository: str) -> None:
    """This rank's writes under the repository go to a private layer, thrown away at exit."""
    from taas_magic.rank.startup import isolate_writes
    from taas_magic.tempdirs import remove_tree
    from taas_magic.writes.rule import probe_overlay

    layer = tempfile.mkdtemp(prefix="taas-job-layer-")
    atexit.register(remove_tree, layer)
    mode = "overlay" if probe_overlay() is None else "python"
    isolate_writes(repository, layer, mode, f"rank {os.environ['RANK']}")
