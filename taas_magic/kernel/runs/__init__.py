"""One run: its plan, the object that owns what it takes, its thread, and the cell that shows it.

- ``runplan.py``: a parsed cell turned into a planned :class:`~.run.Run` (closure, write rule, spec,
  header), everything decided before anything starts.
- ``run.py``: the ``Run``: owns every resource of the run and releases them in reverse.
- ``execution.py``: starts the data workers and each attempt's ranks and hands them to supervision.
- ``background.py``: the run's own thread (``RunThread``) and this kernel's list of runs.
- ``foreground.py``: the cell that waits (as a coroutine or blocking), the interrupt, and the
  console of the ranks' pdb prompts.
- ``views.py``: which view a run gets in a cell (the live view or the text stream), and putting it there.
- ``session.py``: what the line commands set and every cell reads: repository, spares, cluster, runs,
  kept ranks.
- ``rankset.py``: a rank set, which every run borrows: what its ranks hold (backend, server, layers, stacks folder,
  owner tag, the kept group), its state (new, busy, idle, lost, released), its lifetime (one cell, or the session:
  ``--keep``: each a policy, of what a cell's end and a failure cost), and which notebook values they already have.
- ``profiled.py``: a ``--profile`` run's traces gathered, merged and saved (the profiling feature), each rank's
  time and the straggler line (the output feature's) in the cell.
- ``summary.py``: the run in a few words: ``RunSummary``, ``LastRun``, the header line.
"""
