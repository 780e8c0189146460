"""The export face: a taas cell of the notebook written as a job that runs without Jupyter (``%taas export``), and
that job's runtime.

The kernel is one face of the cell stage (the cell run now); export is the other (the cell run later, as ``python
SCRIPT``, ``torchrun``, ``sbatch`` or on Ray). Both prepare a cell the same way (cell/prepared.py: parse, settle,
translate, closure), and start ranks below them; a job's ranks are set up as a cell's (the rank stage's devices and
write rule), fed by the data workers' rule (the feed stage's), started by torch's own elastic launcher.

In the kernel, on the cell's thread (``%taas export PATH [In[N]]``):

- ``command.py``: the line: which cell, prepared as a run of it would be, then carried and written;
- ``carry.py``: what the job takes of the notebook: definitions by source, imports, values; or the one name that
  cannot go;
- ``files.py``: the job's files (the script, its sbatch and Ray entry points, the values beside them), written whole
  or not at all.

In the job, never in a kernel (no IPython, ipykernel or jupyter_client):

- ``job.py``: the script's first and last lines: a rank set up as a taas rank is (devices, the write rule), the
  values loaded, rank 0's names saved for ``taas.load_job``;
- ``launcher.py``: how the ranks start: ``python SCRIPT`` on torch's elastic launcher (with taas's ``--timeout``),
  a Slurm task's rank from Slurm's variables, one Ray actor per rank;
- ``jobfeed.py``: a registered loader, each rank's share of each pass as the data workers would give it.
"""
