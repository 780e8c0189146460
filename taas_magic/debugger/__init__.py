"""JupyterLab's debugger panel on the ranks: a kernel half that multiplexes the panel's DAP requests over
ipykernel's own debugger and the ranks, and a rank half that stops the cell where the panel says.

Runs where its modules say: the kernel's control thread and a run's own thread (panel.py, ranklink.py),
each rank's cell thread (tracer.py, frameview.py).

- ``panel.py``: the kernel's ``debug_request`` answered for taas cells and rank threads, everything else
  passed to ipykernel's debugger; the breakpoints kept for fresh ranks; ``debugInfo`` with the ranks in it.
- ``ranklink.py``: one run's ranks as the panel's threads (``rank K``): questions out, answers and stops
  back over the ranks' own channels, ids made unique; its frames ``PanelCommand``, ``PanelNow``.
- ``tracer.py``: a rank's ``bdb`` tracer, installed only while the panel is on; its frames
  ``PanelStopped``, ``PanelReply``, ``PanelResumed``.
- ``frameview.py``: a stopped rank's stack, scopes, variables and evaluate, as DAP bodies.
"""
