"""The kernel stage: a taas cell planned, started, supervised and drawn, in four rooms from the face down.

- ``magic/``: the IPython face. The ``%%taas`` magic (``#pragma taas`` lines become it) parses
  the cell, chooses the backend and hands the plan to a run or a search; the ``%taas`` line
  commands, the session settings (``%config TaasMagics``), ``%taas help``/``status``, ``%debug``.
- ``trials/``: a search (``--trials K``): many runs of one cell, asked and told through Optuna.
- ``runs/``: one run's plan and lifetime: the plan (closure, write rule, spec), the run that owns
  every resource it takes, its thread, the cell that waits for it (or returns, ``--detach``),
  the views that show its log, and the session that keeps this kernel's runs.
- ``supervision/``: the ranks of one attempt watched until they end: the selector turned into
  typed events, the failure verdict, restarts, the peer server, the data plane, pdb prompts.

Each room imports only the rooms below it (tests/unit/test_layout.py); nothing below the face
knows IPython's magics, and nothing in supervision knows what a run or a search is.
"""
