"""The Slurm engine: a held allocation, and each cell one ``srun`` step in it.

- ``slurmcli.py``: Slurm's own commands (``squeue``, ``scontrol``, ``sinfo``, ``scancel``), run and read;
- ``allocation.py``: the allocation the session holds (``salloc`` with a lifeline), or the
  one the kernel runs inside; its nodes, GPUs and time left; its queue state while it waits;
- ``step.py``: one attempt's ranks as one ``srun`` step, its tasks' output and exits back
  through the kernel's output hub (launch/hosts/outputhub.py), as the Ray engine's agents send theirs;
- ``task.py``: what each task of the step runs (``python -m taas_magic.launch.slurm.task``):
  it says where Slurm put it, takes its rank's plan, and starts and serves the rank with the
  local engine's processes (launch/hosts/agent.py's HostAgent);
- ``taskcommands.py``: the kernel's end of each task's command channel (numbered JSON lines);
- ``courier.py``: prepared elements copied to a rank's node through the kernel, once per node;
- ``backend.py``: the run's backend (launch/contract.py's ``Backend``) on the allocation;
- ``attachment.py``: the session's :class:`SlurmCluster` (launch/contract.py's ``Attachment``):
  the allocation, taken or asked for, and a run's backend on it.
"""
