"""Data workers: registered loaders prepared by CPU processes while the ranks train.

One module per job:

- ``registry.py``: the loaders ``taas.register`` keeps.
- ``plan.py``: what a registered loader is (map-style or iterable), its passes, K (the FeedPlan
  itself travels in the run's spec: taas_magic/runspec.py).
- ``segments.py``: the run's cache directories (RAM, disk) and a worker's segment files.
- ``extract.py``: a worker's view of a loader: its own elements of each pass.
- ``worker.py``: the worker process (``python -m taas_magic.feed.worker``).
- ``coordinator.py``: the kernel's bookkeeping: which element goes to which rank, replay,
  backpressure; pure state, no I/O.
- ``progress.py``: the progress line in the cell.

Elsewhere, by the flow: the data side of one run is set up by the kernel
(kernel/supervision/dataplane.py); what the cell sees in a rank in place of the registered loader is
rank/loaders.py; an element's record format is transfer/records.py.
"""
