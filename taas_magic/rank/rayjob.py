"""An exported job on a Ray cluster: one actor per rank, each running the job's script as that rank.

Runs in the Ray driver (the ``_ray.py`` entry point kernel/magic/jobfiles.py writes) and in the actors. The driver connects to
the cluster (``RAY_ADDRESS``, else ``auto``), starts ``ranks`` actors (a GPU each where the cell had GPUs), asks
rank 0's for its node's address and a free port there (the rendezvous), then has every actor run
``python SCRIPT`` with torchrun's environment (``LOCAL_RANK`` 0: Ray gives each actor its own GPU), in the
driver's working directory (start it where the notebook ran: the cell's relative paths are from there); the
script finds ``RANK`` set and runs as that rank (rank/job.py). The script and that directory must be there on
every node (a shared file system, as a notebook's repository on a cluster is). The driver exits with the first failing
rank's status, or 0, and ends the actors.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def run(script: str, *, ranks: int, gpus: bool) -> None:
    import ray

    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
    folder = os.getcwd()  # the ranks run where the driver was started, as the cell ran where the notebook did

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
