"""An exported job's runtime: its ranks started, each rank set up as a taas rank is, rank 0's names saved.

Runs in the job: the script ``%taas export`` wrote (kernel/magic/jobfiles.py) calls :func:`start` first thing, and
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
import signal
import subprocess
import sys
import tempfile
import types
from dataclasses import dataclass, field
from typing import Any, cast

from taas_magic.procs import omp_threads
from taas_magic.wire import LOOPBACK

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

    def feed(self, loader: Any, *, cpus: int = 1, units: int | None = None, seed: int = 0) -> JobFeed:
        """A registered loader as this rank sees it under taas's data workers: its share of each pass."""
        return JobFeed(loader, self.rank, self.world, max(0, cpus // self.world), units, seed)

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


class _Batches:
    """A map-style loader's elements of one pass, by position: fetched and collated as the DataLoader would."""

    def __init__(self, loader: Any, indices: list[Any]):
        self.loader, self.indices = loader, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int) -> Any:
        dataset, index = self.loader.dataset, self.indices[position]
        if getattr(self.loader, "batch_size", None) is None and getattr(self.loader, "batch_sampler", None) is None:
            return self.loader.collate_fn(dataset[index])
        return self.loader.collate_fn([dataset[i] for i in index])


class JobFeed:
    """A registered loader in a job: each pass, this rank's elements ``j % world == rank`` (taas's data workers hand
    a pass's elements out among the ranks), a map-style loader's sampler reseeded with ``seed + pass`` as they
    reseed it, prepared by ``workers`` DataLoader workers of this rank; ``units`` elements in all, as ``--units``."""

    def __init__(self, loader: Any, rank: int, world: int, workers: int, units: int | None, seed: int):
        self.loader, self.rank, self.world, self.workers = loader, rank, world, workers
        self.units, self.seed, self.passes, self.taken = units, seed, 0, 0

    def __len__(self) -> int:
        return len(range(self.rank, len(self.loader), self.world))

    def __iter__(self) -> Any:
        import torch

        number, self.passes = self.passes, self.passes + 1
        dataset = getattr(self.loader, "dataset", None)
        if dataset is None or not hasattr(dataset, "__getitem__") or isinstance(dataset, torch.utils.data.IterableDataset):
            for j, element in enumerate(self.loader):  # an iterable: read in full, this rank's share kept
                if self._spent():
                    return
                if j % self.world == self.rank:
                    self.taken += 1
                    yield element
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + number)
            order = list(self.loader.batch_sampler if self.loader.batch_sampler is not None else self.loader.sampler)
        mine = _Batches(self.loader, order[self.rank::self.world])
        prepared: Any = torch.utils.data.DataLoader(cast(Any, mine), batch_size=None, num_workers=self.workers)
        for element in prepared:
            if self._spent():
                return
            self.taken += 1
            yield element

    def _spent(self) -> bool:
        return self.units is not None and self.taken * self.world >= self.units


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
        _from_slurm()
    if "RANK" not in os.environ:
        sys.exit(_launch(script, ranks, restarts, timeout))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != ranks:
        print(f"taas: this job was exported for {ranks} rank(s) and runs as {world}", file=sys.stderr)
    _set_up_rank(rank, device, shared)
    return Job(os.path.abspath(script), rank, world)


def _from_slurm() -> None:
    """torchrun's variables from Slurm's, for a rank ``srun`` started (as launch/slurm does)."""
    env = os.environ
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = env.get("SLURM_NTASKS_PER_NODE", env["SLURM_NTASKS"]).split("(")[0]
    if "MASTER_ADDR" not in env:  # the first node's address, as Slurm knows it (task 0 runs there)
        first = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]],
                               capture_output=True, text=True, check=True).stdout.split()[0]
        node = subprocess.run(["scontrol", "show", "node", first], capture_output=True, text=True, check=True).stdout
        env["MASTER_ADDR"] = next((word.split("=", 1)[1] for word in node.split() if word.startswith("NodeAddr=")), first)
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))


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


class _TimedOut(Exception):
    """``--timeout`` passed (SIGALRM): torch's agent stops every rank as it leaves its run."""


def _launch(script: str, ranks: int, restarts: int, timeout: float | None) -> int:
    """``python SCRIPT``: the job's ranks run by torch's own elastic launcher, as ``torchrun --standalone
    --nproc-per-node RANKS --max-restarts RESTARTS SCRIPT`` would (a loopback rendezvous on a free port; after a
    failure every rank starts again, ``TORCHELASTIC_RESTART_COUNT`` the attempt; each rank leads its own process
    group, stopped whole). taas adds rank 0's output here, the others' in the job folder's ``logs/`` (torch's
    layout: ``RUN/attempt_N/RANK/stdout.log``), and ``timeout``: then every rank is stopped, and the exit status is
    124. The job's exit status: 0, or the first failed rank's."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(omp_threads(ranks)))  # the host's cores among its ranks, as a cell's
    logs = DefaultLogsSpecs(log_dir=os.path.join(job_folder(script), "logs"),
                            redirects={rank: Std.ALL for rank in range(1, ranks)})
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=f"taas-job-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint=f"{LOOPBACK}:0", max_restarts=restarts,
                          monitor_interval=0.1, logs_specs=logs)
    if timeout is not None:
        signal.signal(signal.SIGALRM, _time_is_up)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        elastic_launch(config, entrypoint=sys.executable)(script)
        return 0
    except ChildFailedError as failed:
        return failed.get_first_failure()[1].exitcode or 1
    except _TimedOut:
        print(f"taas: the job ran past its --timeout {timeout:g} s: stopped", file=sys.stderr)
        return 124
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _time_is_up(signum: int, frame: object) -> None:
    raise _TimedOut()
