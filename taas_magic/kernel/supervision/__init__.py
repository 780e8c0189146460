"""Supervising one run's ranks (and data workers) from the kernel: events in, a verdict out.

- ``server.py``: the listener: accepts the peers that prove the run's key.
- ``mux.py``: sockets, pipes and exits turned into typed events.
- ``supervisor.py``: the router (results, output, reports, data deliveries, pdb prompts) and the
  attempt's ranks attached, stepped, stopped, explained.
- ``verdict.py``: the pure failure policy: first failure, the silent-death rule, settling.
- ``attempts.py``: the one supervision loop: each attempt's ranks started or reused, watched, and
  what a failure costs asked of a :class:`Policy`; always closes what the policy does not keep.
- ``restarts.py``: restart-on-failure (``--restarts``), a policy: which failures start the ranks
  again, and the restart line.
- ``keptcell.py``: keep-on-failure (``--keep``), a policy: kept ranks, and what a failure or an
  interrupt keeps.
- ``replacement.py``: a kept rank that died, replaced by a new process while the others keep theirs.
- ``dataplane.py``: the data workers' kernel half, set up before any process starts.
- ``prompts.py``: the ranks' pdb prompts between the ranks and the waiting cell; the hold.

It never asks which backend started the ranks.
"""
