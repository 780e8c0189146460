"""A search (``--trials K``): one cell run as many trials, each an ordinary run (kernel/runs/).

- ``searchplan.py``: checks the search's options and makes its plan (slots, the study, the header),
  before any trial starts.
- ``searchrun.py``: runs the trials a few at a time on its own thread, asks and tells Optuna
  (taas_magic/search/ holds the study's and the rank's halves), prunes, and draws the table and chart.
"""
