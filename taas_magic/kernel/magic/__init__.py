"""The IPython face: ``%%taas`` and ``%taas``, the session's settings, and what a person reads.

``magics.py`` is the magic (parse -> plan -> run -> show); ``commands.py`` the table of the
``%taas`` line commands (dispatch, help, the docs' reference), ``linecommands.py`` what the
session's commands do, ``runcommands.py`` those about one run (attach, wait, stop);
``settings.py`` the ``TaasMagics`` traits made from the option table; ``status.py`` the text of
``%taas help``, ``status`` and ``runs``; ``debug.py`` ``%debug`` and ``%taas debug`` after a rank
failed; ``fromcode.py`` what ``taas.wait()``, ``taas.trials()``, ``taas.metrics()`` and the
notebook's ``taas.load_checkpoint()`` read from the loaded extension's session.
"""
