"""Why a run hangs: every rank's stacks, dumped on a signal and summarised in the kernel, and said while it hangs.

- ``dump.py``: the rank's half: faulthandler armed on a signal, writing to the run's stacks folder.
- ``stacks.py``: the kernel's half: signal every rank, read their stacks, one summary line.
- ``waiting.py``: the rank's half of the hang line: how long its cell has waited in one collective (with its health).
- ``hangline.py``: the kernel's half: a rank long in one collective, and the cell says where every rank is.
"""
