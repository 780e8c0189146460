"""The local engine: a run's ranks and data workers as processes on this host (the kernel's).

- ``backend.py``: the run's backend (launch/contract.py's ``Backend``) on this host;
- ``processes.py``: fresh rank and worker processes, each in its own session with a stdin
  lifeline, stopped INT -> TERM -> KILL (also what a cluster host's agent runs);
- ``spares.py``: warm spare ranks, torch imported, taken by the next cell;
- ``factories.py``: the pool's factories: the one serving, the one warming torch's compiler, the retired;
- ``sparefactory.py``: the process that forks spares in milliseconds once it has imported;
- ``standby.py``: spares warmed off the supervisor's thread while a run goes.
"""
