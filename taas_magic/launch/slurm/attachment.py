"""The Slurm engine's attachment: the allocation the session holds (``%taas cluster slurm [OPTIONS]``).

Runs in the kernel. No options, inside a Slurm job: that job. Otherwise ``salloc`` with the options,
its queue state shown in the cell while it waits (launch/slurm/allocation.py). At the extension's
load (``$TAAS_CLUSTER=slurm``) only the job the kernel runs inside is taken: nothing waits in a queue.
"""

from __future__ import annotations

import os

from taas_magic.errors import ClusterError
from taas_magic.launch.contract import Show
from taas_magic.launch.slurm import slurmcli
from taas_magic.launch.slurm.allocation import Allocation, AllocationRequest
from taas_magic.launch.slurm.backend import SlurmBackend


class SlurmCluster(Allocation):
    """The session's attachment (launch/contract.py's ``Attachment``): the allocation, and a run's backend on it."""

    @classmethod
    def attach(cls, options: str, show: Show | None) -> "SlurmCluster":
        """The job this kernel runs inside when no option is given and there is one (always, at load:
        ``show`` None), else a new allocation, ``show`` given its queue state while it waits."""
        why = slurmcli.missing()
        if why is not None:
            raise ClusterError(f"taas: {why}")
        request = AllocationRequest.parse(options)
        if show is None or (request.empty and os.environ.get("SLURM_JOB_ID")):
            return cls.current()
        try:
            return cls.request(request, show)
        except KeyboardInterrupt:
            raise ClusterError("taas: interrupted while the allocation was queued: it was cancelled, nothing is held") from None

    @property
    def attached(self) -> bool:
        return not self.released

    def place(self, gpus: int, per_host: int | None, wait: float) -> SlurmBackend:
        """``--per-host`` and ``--place-timeout`` are the Ray engine's: Slurm places the tasks, and
        the allocation is already held."""
        return SlurmBackend(self, gpus)

    def detach(self) -> None:
        self.release()
