"""What runs inside a rank process: ``python -m taas_magic.rank``.

Nothing here imports IPython or torch eagerly: a rank pays for what its cell uses.

- ``__main__.py``: the entry point of a rank, a warm spare (``--spare``) and the spare factory
  (``--factory``).
- ``main.py``: a rank's program: lifeline, handshake, the cell, what goes back, exit.
- ``betweencells.py``: a kept rank (``--keep``) between cells: ``CellDone``, then the next cell's spec
  and closure; the kernel's interrupt as SIGINT; a failed cell's ``Abandon``.
- ``abortable.py``: kept ranks' gloo process group, whose collectives a failed cell ends and whose
  communicator is renewed under the same group object.
- ``communicator.py``: one communicator of an abortable group: made, its sockets shut down, reaped.
- ``recovery.py``: what a failed kept cell left half done in its models (FSDP2's iteration state), reset.
- ``heal.py``: ``%taas heal --from K``: a kept rank's names copied into the ranks that lack them.
- ``startup.py``: how every process the kernel starts begins and ends (a rank, a warm spare, a data
  worker): watchdog, handshake, write rule, lifeline, channel, exit.
- ``execute.py``: the cell, run as a module's body, the way IPython would but not interactively.
- ``shell.py``: a non-interactive IPython shell for the rank, built only when the cell needs one.
- ``spare.py``: a warm spare: Python and torch imported ahead of time, waiting for a cell.
- ``factory.py``: the spare factory: imports once, forks the spares.
- ``lifeline.py``: a rank never outlives the kernel, nor leaves its children behind.
- ``devices.py``: GPU binding before the cell; nccl served by gloo on CPU.
- ``loaders.py``: the rank's half of a registered loader: prepared elements.
- ``inbox.py``: the channel's one reader thread during the cell: elements, a trial's answers, pdb's
  lines, the hold.
- ``cellpdb.py``: ``breakpoint()``, ``pdb.set_trace()``, ``dist.breakpoint`` and ``%pdb on``'s
  post-mortem -> pdb prompting through the kernel.
- ``lightning.py``: the ``Trainer``'s extra logger, for the live chart.
- ``steps.py``: where a training step ends: the outermost ``optimizer.step`` of the cell's first optimizer,
  told to the straggler line's count and ``--profile``'s marks.
- ``groups.py``: the default process group outlives the cell while its sharded names are gathered;
  kept ranks keep theirs (abortable on CPU).
- ``identity.py``: whether this process is a rank, its device, seed and report; what ``import taas``
  answers by.
"""
