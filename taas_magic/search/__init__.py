"""Many trials from one cell (``--trials K``): the search's parts that are not the kernel's loop.

The rank's half:

- ``trial.py``: ``taas.trial()``; in a search's rank each suggestion asks the kernel, alone
  each is its ``default=``.

The kernel's half (the loop that runs the trials is kernel/trials/searchrun.py):

- ``study.py``: the Optuna study (sampler, pruner, the SQLite file of ``--study``), and telling it
  how each trial ended.
- ``space.py``: ``--sampler grid``'s grid, read from the cell's literal suggestions.
- ``link.py``: one trial's answers to its ranks, its objective, its pruning.

The search and the early stopping are Optuna's (ask and tell); nothing here chooses a point.
"""
