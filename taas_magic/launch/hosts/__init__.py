"""What the cluster engines (Ray, Slurm) share: a host's agent, and where its output comes back.

- ``agent.py``: one per host (a Ray actor, or a Slurm task's): starts that host's ranks with the
  local engine's processes and pumps their output and exits back to the kernel;
- ``outputhub.py``: the kernel's end: the agents' authenticated connections, each rank's output
  a socket the supervisor reads as it reads a local pipe.
"""
