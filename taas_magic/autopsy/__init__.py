"""Why a run hangs: every rank's stacks, dumped on a signal and summarised in the kernel.

- ``dump.py``: the rank's half: faulthandler armed on a signal, writing to the run's stacks folder.
- ``stacks.py``: the kernel's half: signal every rank, read their stacks, one summary line.
"""
