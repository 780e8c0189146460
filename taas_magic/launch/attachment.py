"""Attaching the kernel to a cluster, and what the cluster has (``%taas cluster``).

Two engines: Ray and Slurm. ``%taas cluster ADDRESS`` takes anything ``ray.init(address=...)``
accepts (``HOST:PORT``, ``ray://HOST:PORT``, ``auto``); ``%taas cluster slurm [OPTIONS]`` holds a
Slurm allocation (launch/slurm/allocation.py); ``$TAAS_CLUSTER`` (an address, or ``slurm``: the
job the kernel runs inside) does the same when the extension loads. ``%taas cluster off`` (or
``local``) detaches and cells run as local processes again. Ray is imported only here and in
``launch/ray.py``, only once a Ray cluster is asked for: the local mode never needs it.

Either attachment is an :class:`Attachment`: its nodes, a run's backend on it, its status
lines, and letting go of it; nothing above asks which engine it is.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from taas_magic.errors import ClusterError
from taas_magic.launch.placement import Node

if TYPE_CHECKING:
    from taas_magic.launch.backend import Backend

ENV_VAR = "TAAS_CLUSTER"
INSTALL_HINT = 'the cluster mode needs Ray: pip install "taas-magic[ray]"'


class Attachment(Protocol):
    """What the session holds when a cluster is attached (a Ray :class:`Cluster`, or a Slurm
    allocation: launch/slurm/allocation.py's ``Allocation``)."""

    def nodes(self) -> list[Node]: ...

    def place(self, gpus: int, per_host: int | None, wait: float) -> "Backend":
        """A run's backend on the cluster, its resources held; raises LaunchError, holding nothing."""

    def status_lines(self) -> list[str]: ...

    def detach(self) -> None: ...


def import_ray() -> Any:
    # Importing Ray in a kernel without ipywidgets prints two notices (tqdm's and Ray's own)
    # about rich widgets we never show; they would land in the person's cell.
    logging.getLogger("ray.widgets.util").setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="IProgress not found")
            import ray
    except ImportError as exc:
        raise ClusterError(f"taas: {INSTALL_HINT} ({exc})") from None
    return ray


@dataclass
class Cluster:
    """The kernel's attachment to one Ray cluster."""

    address: str
    ray: Any
    notebook_node_id: str

    @classmethod
    def attach(cls, address: str) -> "Cluster":
        ray = import_ray()
        _check_reachable(address)
        if ray.is_initialized():
            ray.shutdown()
        try:
            # The driver's own output stays out of the cell: ranks' output reaches it through
            # the supervisor, and Ray's worker logs would otherwise be echoed into whatever
            # cell is current.
            ray.init(address=address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
        except Exception as exc:  # noqa: BLE001 - Ray raises many types for an unreachable cluster
            raise ClusterError(f"taas: could not attach to the Ray cluster at {address!r}: {exc}") from None
        return cls(address, ray, ray.get_runtime_context().get_node_id())

    def place(self, gpus: int, per_host: int | None, wait: float) -> "Backend":
        from taas_magic.launch.backend import ClusterBackend

        return ClusterBackend.place(self, gpus, per_host, wait)

    def detach(self) -> None:
        if self.ray.is_initialized():
            self.ray.shutdown()

    def nodes(self) -> list[Node]:
        """Alive nodes with their total and free GPUs and CPUs."""
        free = self.ray._private.state.state.available_resources_per_node()  # private API: see taas_magic/private.py
        nodes = []
        for entry in self.ray.nodes():
            if not entry.get("Alive"):
                continue
            node_id = entry["NodeID"]
            total = entry.get("Resources", {})
            available = free.get(node_id, {})
            nodes.append(
                Node(
                    node_id=node_id,
                    address=entry["NodeManagerAddress"],
                    gpus_total=int(total.get("GPU", 0)),
                    gpus_free=int(available.get("GPU", 0)),
                    cpus_total=float(total.get("CPU", 0)),
                    cpus_free=float(available.get("CPU", 0)),
                    is_notebook_host=node_id == self.notebook_node_id,
                )
            )
        return nodes

    def status_lines(self) -> list[str]:
        try:
            nodes = self.nodes()
        except Exception as exc:  # noqa: BLE001 - the cluster went away under us
            return [f"cluster: Ray at {self.address}, not reachable now ({type(exc).__name__}: {exc})"]
        lines = [
            f"cluster: Ray at {self.address}, {len(nodes)} node(s), "
            f"{sum(n.gpus_free for n in nodes)}/{sum(n.gpus_total for n in nodes)} GPU free, "
            f"{sum(n.cpus_free for n in nodes):g}/{sum(n.cpus_total for n in nodes):g} CPU free"
        ]
        for node in sorted(nodes, key=lambda n: (not n.is_notebook_host, n.node_id)):
            mark = "  (this notebook)" if node.is_notebook_host else ""
            lines.append(
                f"  {node.label}: {node.gpus_free}/{node.gpus_total} GPU, {node.cpus_free:g}/{node.cpus_total:g} CPU free{mark}"
            )
        return lines


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail at once on a HOST:PORT (or ray://HOST:PORT) that nothing answers: ray.init would
    retry for minutes, printing its connection warnings into the cell."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto", "local" or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise ClusterError(
            f"taas: no Ray cluster answers at {address!r} ({exc}); check the address (ray status shows it)"
        ) from None


def address_from_environment() -> str | None:
    value = os.environ.get(ENV_VAR, "").strip()
    return value if value and value != "local" else None
