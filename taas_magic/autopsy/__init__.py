"""Why a run hangs: each rank arms faulthandler (dump.py), and the kernel reads and summarises the stacks (stacks.py)."""
