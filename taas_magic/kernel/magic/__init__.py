"""The IPython face: ``%%taas`` and ``%taas``, the session's settings, and what a person reads.

- ``magics.py``: the magic (parse -> settle -> plan -> run -> show and wait -> bind); ``TaasMagics``
  holds the session's settings as traitlets.
- ``commands.py``: the table of the ``%taas`` line commands, ``COMMANDS``: dispatch, help, the docs'
  reference.
- ``linecommands.py``: what the session's commands do (``status``, ``config``, ``cluster``, ``warm``,
  ``trials``, ``study``).
- ``runcommands.py``: those about one run (``runs``, ``attach``, ``wait``, ``stop``), from any cell.
- ``settings.py``: the ``TaasMagics`` traits made from the option table; refusing a value out of range.
- ``status.py``: the text of ``%taas help``, ``status`` and ``runs``.
- ``debug.py``: ``%debug`` and ``%taas debug`` after a rank failed.
- ``fromcode.py``: what ``taas.wait()``, ``taas.trials()``, ``taas.metrics()`` and the notebook's
  ``taas.load_checkpoint()`` read from the loaded extension's session.
"""
