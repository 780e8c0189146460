"""The engines: the one place that names them, each with a lazy factory (as torch elastic's rendezvous registry).

Runs in the kernel (and :func:`slurm_first_node` in an exported job's ranks too). Without an attachment a run's
ranks are processes on this host (:func:`local_backend`, from :func:`warm_spares`); :func:`attach` turns
``%taas cluster`` text, or ``$TAAS_CLUSTER`` when the extension loads, into a cluster's attachment. An engine is imported only
when asked for: the local mode never imports Ray. A fourth engine is a package beside ``local/``,
``ray/`` and ``slurm/`` implementing launch/contract.py, and one line in :data:`CLUSTER_WORDS` (or
:data:`ADDRESSES`): ``%taas cluster WORD``'s row in ``%taas help`` and the docs is made from that line
(kernel/magic/commands.py), so no engine is named outside launch/.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from taas_magic.launch.contract import Attachment, Backend, GpuSlice, Show, Spares

ENVIRONMENT = "TAAS_CLUSTER"  # an address, or ``slurm`` (the job the kernel runs inside), attached at load
THIS_HOST = ("off", "local", "")  # ``%taas cluster off``: detach, cells run on this host


def _ray(address: str, show: Show | None) -> Attachment:
    from taas_magic.launch.ray.attachment import RayCluster

    return RayCluster.attach(address)


def _slurm(options: str, show: Show | None) -> Attachment:
    from taas_magic.launch.slurm.attachment import SlurmCluster

    return SlurmCluster.attach(options, show)


@dataclass(frozen=True)
class Engine:
    """How ``%taas cluster`` reaches one engine: its factory, and its row in ``%taas help`` and the docs."""

    attach: Callable[[str, Show | None], Attachment]  # (the line's argument, where to say what it waits for)
    argument: str  # as help names it: "OPTIONS"
    help: str  # what the row does


# ``%taas cluster WORD [OPTIONS]``: the engine named by its first word, given the rest (kernel/magic/commands.py
# makes one row of each).
CLUSTER_WORDS: dict[str, Engine] = {
    "slurm": Engine(_slurm, "OPTIONS", "hold a Slurm allocation (salloc options; none: the job this kernel runs in)"),
}
# ``%taas cluster ADDRESS``: anything else is an address (``HOST:PORT``, ``ray://HOST:PORT``, ``auto``).
ADDRESSES = Engine(_ray, "ADDRESS|local", "run ranks on a Ray cluster (ray.init address), or back to this host")


def attach(given: str | None, show: Show | None = None, word: str | None = None) -> Attachment | None:
    """The attachment ``%taas cluster [WORD] GIVEN`` asks for: the engine ``word`` names, given ``given``; no
    ``word``: an address, or this host. ``given`` None: ``$TAAS_CLUSTER``'s, at load (where nothing may wait in
    a queue: ``show`` is None), its first word read as an engine's where it is one. None: this host (``off``,
    ``local``, unset).

    Raises:
        ClusterError: the engine is not installed, the cluster does not answer, or it refused.
    """
    if word is not None:
        return CLUSTER_WORDS[word].attach(given or "", show)
    text = (os.environ.get(ENVIRONMENT, "") if given is None else given).strip()
    if text in THIS_HOST:
        return None
    first, _, rest = text.partition(" ")
    engine = CLUSTER_WORDS.get(first) if given is None else None
    if engine is not None:
        return engine.attach(rest.strip(), show)
    return ADDRESSES.attach(text, show)


def slurm_first_node(nodelist: str) -> str:
    """The address Slurm reaches the first node of ``nodelist`` by (where a job's task 0 runs), as the Slurm
    engine reads it: for an exported job's ranks under ``srun`` (export/launcher.py), outside any kernel."""
    from taas_magic.launch.slurm import slurmcli

    return slurmcli.node_address(slurmcli.hostnames(nodelist)[0])


def warm_spares() -> Spares:
    """This host's warm spares (none yet: ``keep`` or ``prepare`` starts them)."""
    from taas_magic.launch.local.spares import SparePool

    return SparePool()


def local_backend(gpus: int, spares: Spares | None, refill: Callable[[], int] | None, device: str = "auto",
                  gpu_slice: GpuSlice | None = None) -> Backend:
    """A run's ranks as processes on this host, from ``spares`` (:func:`warm_spares`'s) when they
    serve; ``refill()``: how many to keep warm for what comes next. Raises LaunchError, holding
    nothing, where the host cannot (too few GPUs, or none)."""
    from taas_magic.launch.local.backend import LocalBackend
    from taas_magic.launch.local.spares import SparePool

    assert spares is None or isinstance(spares, SparePool), "the local engine's spares are warm_spares()'"
    return LocalBackend(gpus, spares, refill, device, gpu_slice)
