"""How an exported job's ranks start: ``python SCRIPT`` on torch's own elastic launcher, a Slurm task's rank from Slurm's
variables, or one Ray actor per rank.

Runs in the job, never in a kernel: :func:`run_elastic` and :func:`rank_from_slurm` from export/job.py's ``start``
(the script's first line), :func:`run_on_ray` as the ``SCRIPT_ray.py`` entry point export/files.py writes. taas adds
to each only what a cell has and the launcher lacks: the ``--timeout``, rank 0's output on the console, a Slurm node's
address read as the Slurm engine reads it (launch/engines.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

from taas_magic.launch import engines
from taas_magic.procs import omp_threads
from taas_magic.wire import LOOPBACK

TIMED_OUT = 124  # the job's exit status when it ran past its --timeout (as timeout(1)'s)


class _TimedOut(Exception):
    """``--timeout`` passed (SIGALRM): torch's agent stops every rank as it leaves its run."""


def run_elastic(script: str, ranks: int, restarts: int, timeout: float | None, folder: str) -> int:
    """``python SCRIPT``: the job's ranks run by torch's own elastic launcher, as ``torchrun --standalone
    --nproc-per-node RANKS --max-restarts RESTARTS SCRIPT`` would (a loopback rendezvous on a free port; after a
    failure every rank starts again, ``TORCHELASTIC_RESTART_COUNT`` the attempt; each rank leads its own process
    group, stopped whole). taas adds rank 0's output here, the others' in ``folder``'s ``logs/`` (torch's layout:
    ``RUN/attempt_N/RANK/stdout.log``), and ``timeout``: then every rank is stopped, and the exit status is
    :data:`TIMED_OUT`. The job's exit status: 0, or the first failed rank's."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(omp_threads(ranks)))  # the host's cores among its ranks, as a cell's
    logs = DefaultLogsSpecs(log_dir=os.path.join(folder, "logs"), redirects={rank: Std.ALL for rank in range(1, ranks)})
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
        return TIMED_OUT
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _time_is_up(signum: int, frame: object) -> None:
    raise _TimedOut()


def rank_from_slurm() -> None:
    """torchrun's variables from Slurm's, for a task ``srun`` started (as the Slurm engine's tasks read them); the
    rendezvous on the first node of the job (task 0 runs there), at the address Slurm reaches it by."""
    env = os.environ
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = env.get("SLURM_NTASKS_PER_NODE", env["SLURM_NTASKS"]).split("(")[0]
    if "MASTER_ADDR" not in env:
        env["MASTER_ADDR"] = engines.slurm_first_node(env["SLURM_JOB_NODELIST"])
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))


def run_on_ray(script: str, *, ranks: int, gpus: bool) -> None:
    """``python SCRIPT_ray.py``: the job on the Ray cluster it connects to (``RAY_ADDRESS``, else ``auto``), one actor
    per rank (a GPU each where the cell had GPUs). Rank 0's actor gives its node's address and a free port there
    (the rendezvous); then every actor runs ``python SCRIPT`` with torchrun's environment (``LOCAL_RANK`` 0: Ray gives
    each actor its own GPU) in this process's working directory (start it where the notebook ran: the cell's
    relative paths are from there), so the script finds ``RANK`` set and runs as that rank. The script and that
    directory must be on every node (a shared file system, as a notebook's repository on a cluster is). Exits with
    the first failing rank's status, or 0, the actors ended."""
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
    folder = os.getcwd()

    @ray.remote(num_gpus=1 if gpus else 0, num_cpus=1)
    class Rank:
        def rendezvous(self) -> tuple[str, int]:
            with socket.socket() as probe:
                probe.bind(("", 0))
                return ray.util.get_node_ip_address(), int(probe.getsockname()[1])

        def run(self, env: dict[str, str]) -> int:
            return subprocess.run([sys.executable, script], env={**os.environ, **env}, cwd=folder, check=False).returncode

    actors = [Rank.remote() for _ in range(ranks)]  # type: ignore[attr-defined]  # ray.remote makes .remote at run time
    try:
        address, port = ray.get(actors[0].rendezvous.remote())
        codes = ray.get([actor.run.remote({"RANK": str(k), "WORLD_SIZE": str(ranks), "LOCAL_RANK": "0",
                                           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": address, "MASTER_PORT": str(port)})
                         for k, actor in enumerate(actors)])
    finally:
        for actor in actors:
            ray.kill(actor)
    failed = [code for code in codes if code]
    sys.exit(failed[0] if failed else 0)
