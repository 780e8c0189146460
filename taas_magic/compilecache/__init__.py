"""A compiled cell run again in fresh ranks: the session's compile cache, both halves.

Every taas cell gets fresh processes, and ``torch.compile`` in a fresh process starts over:
Dynamo traces, AOTAutograd and Inductor lower, and a C++ (or Triton) compiler builds the kernels.
torch keeps the last two on disk; taas points every local rank of a session at one owner-only
folder of the session, and carries torch's portable cache artifacts across its ranks:

- ``folder.py`` (the kernel's half): the folder, made once a session and removed when the
  extension unloads or the kernel exits, and each rank's variables pointing Inductor's and
  AOTAutograd's caches into it (a person's own values of those variables win);
- ``artifacts.py`` (the rank's half): after a cell that compiled, the rank saves
  ``torch.compiler.save_cache_artifacts()`` into the folder; a later rank whose Inductor caches
  are elsewhere (a person's own ``TORCHINDUCTOR_CACHE_DIR``) loads them when its cell first
  imports Dynamo (never failing the cell: a warning, once).

Once a session's ranks compiled (the folder has entries), the warm spares come with Dynamo and
Inductor imported and Inductor's CPU probe answered (launch/local/factories.py): what no cache
holds, and most of a cached compile in a new process.

``TaasMagics.compile_cache = False`` turns it off: the ranks then use torch's own per-user cache,
as under torchrun.
"""
