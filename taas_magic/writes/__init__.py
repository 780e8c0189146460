"""Only rank 0 writes to the repository, except the folders of collective checkpoints.

- ``rule.py``: the kernel's rule: the repository, the overlay probe, the scratch layers and their report.
- ``namespace.py``: in a rank other than 0: its user + mount namespace and the overlay over the repository, made anew.
- ``refresh.py``: in a rank other than 0: the overlay made anew as each collective returns and each cell starts.
- ``divert.py``: the Python fallback where namespaces are forbidden: the patched file functions, over ``layer.py``.
- ``layer.py``: the fallback's private layer: where each path is read and written, copy-up, tombstones.
- ``shared.py``: in a rank: one folder of the repository written in place (a bind mount, or the layer passing it).
- ``checkpoints.py``: ``taas.save_checkpoint`` / ``taas.load_checkpoint``'s files: a run's folder in the
  repository, atomic, rank 0's (a sharded save every rank's), the newest kept.
- ``savers.py``: in a rank: collective saves recognised from the save itself (DCP, accelerate, the HF Trainer,
  ``taas.shared``, ``--shared``); their folders shared and named to the kernel.
- ``completeness.py``: whether a DCP checkpoint is whole (.metadata against its files, read without running its
  pickle), and the kernel's ledger of a run's collective saves.
- ``away.py``: on a cluster, whether a host sees the notebook's repository (the run's marker: the kernel writes it,
  the host's agent reads it); where a host's ranks write when it does not.
- ``unseen.py``: on such a host: the repository's files it lacks, named in each rank's view, unreadable, with one line.
- ``outbox.py``: in a rank on such a host: what it wrote for the repository, sent to the kernel as it ends.
- ``landing.py``: the kernel's half: those files written into the repository, each whole, before the check.
"""
