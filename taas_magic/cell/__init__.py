"""The cell stage: the cell's text -> Python with its line numbers, its options, the names it reads and their values.

Pure: text in, values or a one-line error out; nothing is launched here.

- ``transformer.py``: routes ``#!...`` + ``#pragma taas`` cells to ``%%taas``, then to one ``await``
  of the magic's coroutine where the kernel runs cells as coroutines.
- ``options.py``: the option table ``OPTIONS`` (every option once), the value types, ``PragmaError``,
  the usage line.
- ``pragma.py``: the cell's head parsed into ``PragmaOptions`` or a one-line error; a run's options
  settled from the pragma and the session.
- ``cellcode.py``: IPython syntax -> Python, with the person's line numbers.
- ``freenames.py``: the names a cell may read before binding them.
- ``closure.py``: their values -> one pickle, name by name.
- ``prepared.py``: a cell prepared to run, the one path of both faces (the magic's run, ``%taas export``).
"""
