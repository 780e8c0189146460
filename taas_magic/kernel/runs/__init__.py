"""One run: its plan, the object that owns what it takes, its thread, and the cell that shows it.

``runplan.py`` turns a parsed cell into a planned :class:`~.run.Run` (closure, write rule,
spec, header); ``run.py`` owns every resource of the run and releases them in reverse;
``execution.py`` starts the data workers and each attempt's ranks and hands them to
supervision; ``background.py`` is the run's thread and this kernel's list of runs;
``foreground.py`` the cell that waits (and serves pdb prompts); ``views.py`` and
``frontend.py`` choose and feed the live view or the text stream; ``session.py`` is what
the line commands set and every cell reads; ``summary.py`` the run in a few words.
"""
