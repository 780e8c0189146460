"""The launch stage: a run's ranks and data workers started where the session says, by engine.

- ``contract.py``: what the kernel holds of an engine, only protocols and values: the plan, the
  process group and its children, the backend, the attachment, the courier, the warm spares;
- ``engines.py``: the one place that names the engines (``%taas cluster`` text or
  ``$TAAS_CLUSTER`` into an attachment; this host's backend and spares), each imported when asked for;
- ``rankenv.py``: torchrun's environment for each rank, the device plan, ports;
- ``placement.py``: which hosts of a cluster run which ranks and data workers;
- ``local/``: the local engine: ranks as processes on this host, from warm spares;
- ``ray/``: the Ray engine: a placement group and one agent per host;
- ``slurm/``: the Slurm engine: a held allocation, each attempt one ``srun`` step;
- ``hosts/``: what the Ray and Slurm engines share on a cluster's hosts: the host agent, which runs
  its ranks as the local engine does, and the kernel's output hub, where their output comes back.

The kernel imports only ``contract``, ``engines``, ``rankenv`` and ``placement``
(tests/unit/test_layout.py); a fourth engine is one package here and one line in engines.py.
"""
