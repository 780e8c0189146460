"""The Ray engine: a run's ranks under one agent per host of a Ray cluster (``%taas cluster ADDRESS``).

- ``attachment.py``: the kernel attached to one Ray cluster (:class:`RayCluster`): its nodes;
- ``backend.py``: the run's backend on it (:class:`RayBackend`), placed by launch/placement.py;
- ``processes.py``: the GPUs held as one placement group, an agent per host (launch/hosts/agent.py),
  and the ranks and data workers they start, as one process group (:class:`RayLaunch`);
- ``courier.py``: prepared elements carried between hosts through Ray's object store.

Ray is imported only in this package, only once a Ray cluster is asked for.
"""
