"""The Ray engine's attachment: the kernel attached to one Ray cluster (``%taas cluster ADDRESS``).

Runs in the kernel. ADDRESS is anything ``ray.init(address=...)`` accepts (``HOST:PORT``,
``ray://HOST:PORT``, ``auto``). Ray is imported only here and in the Ray engine's other modules,
only once a Ray cluster is asked for: the local mode never needs it. One Ray cluster at a time:
``ray.init`` for another lets go of this one (:attr:`RayCluster.attached` turns False).
"""

from __future__ import annotations

import logging
import socket
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from taas_magic.errors import ClusterError
from taas_magic.launch.placement import Node

if TYPE_CHECKING:
    from taas_magic.launch.ray.backend import RayBackend

INSTALL_HINT = 'the cluster mode needs Ray: pip install "taas-magic[ray]"'


_CURRENT: list[RayCluster] = []  # the one Ray cluster this process is attached to (ray.init is per process)


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
class RayCluster:
    """The kernel's attachment to one Ray cluster (launch/contract.py's ``Attachment``)."""

    address: str
    ray: Any
    notebook_node_id: str

    @classmethod
    def attach(cls, address: str) -> "RayCluster":
        """Attached to the cluster at ``address`` (the last Ray cluster let go of first); raises
        ClusterError at once where nothing answers there."""
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
        attached = cls(address, ray, ray.get_runtime_context().get_node_id())
        _CURRENT[:] = [attached]
        return attached

    @property
    def attached(self) -> bool:
        return bool(_CURRENT) and _CURRENT[0] is self and self.ray.is_initialized()

    def place(self, gpus: int, per_host: int | None, wait: float) -> "RayBackend":
        from taas_magic.launch.ray.backend import RayBackend

        return RayBackend.place(self.ray, self.nodes, gpus, per_host, wait)

    def detach(self) -> None:
        if self.attached:
            self.ray.shutdown()
        _CURRENT[:] = [held for held in _CURRENT if held is not self]

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
