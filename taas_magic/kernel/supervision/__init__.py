"""Supervising one run's ranks (and data workers) from the kernel: events in, a verdict out.

``server.py`` accepts the peers that prove the run's key; ``mux.py`` turns sockets, pipes and
exits into typed events; ``supervisor.py`` is the loop that routes them (results, output,
reports, data deliveries, pdb prompts); ``verdict.py`` the pure failure policy;
``attempts.py`` and ``restarts.py`` the restart loop and its rules; ``dataplane.py`` the data
workers' kernel half; ``prompts.py`` the ranks' pdb prompts between the ranks and the cell.
It never asks which backend started the ranks.
"""
