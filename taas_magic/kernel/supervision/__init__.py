"""Supervising one run's ranks (and data workers) from the kernel: events in, a verdict out.

- ``server.py``: the listener: accepts the peers that prove the run's key.
- ``mux.py``: sockets, pipes and exits turned into typed events.
- ``supervisor.py``: the loop that routes them (results, output, reports, data deliveries, pdb
  prompts); always reaps the ranks.
- ``verdict.py``: the pure failure policy: first failure, the silent-death rule, settling.
- ``attempts.py``: the restart loop: start the ranks, supervise them, start again or end.
- ``restarts.py``: which failures start the ranks again, and the restart line.
- ``keptcell.py``: one cell on kept ranks (``--keep``): what a failure or an interrupt keeps.
- ``dataplane.py``: the data workers' kernel half, set up before any process starts.
- ``prompts.py``: the ranks' pdb prompts between the ranks and the waiting cell; the hold.

It never asks which backend started the ranks.
"""
