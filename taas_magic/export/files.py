"""The files of an exported job: the script, its sbatch and Ray entry points, the notebook's values beside them.

Runs in the kernel, on the cell's thread (``%taas export``, export/command.py), after export/carry.py decided
what goes. Everything is written to temporary names first and moved into place only once all of it is written, so a
failure leaves the files of an earlier export as they were. The files are the person's own (mode 0644 for the
scripts, the job folder 0700: it holds the notebook's values).

For ``train.py``:

- ``train.py``: runs as ``python train.py`` (it starts its ranks itself) and under ``torchrun --nproc-per-node N``;
- ``train.sbatch``: ``sbatch train.sbatch`` runs it with ``srun``, one task per rank;
- ``train_ray.py``: ``python train_ray.py`` (or ``ray job submit -- python train_ray.py``) runs it on the Ray
  cluster it connects to, one task per rank, each with a GPU where the cell had one;
- ``train.taas/values.pt``: the values the cell reads (``torch.save``), loaded after the script's definitions;
  ``train.taas/results.pt`` is where rank 0's names land (export/job.py), for ``taas.load_job("train.py")``.
"""

from __future__ import annotations

import ast
import datetime
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass

from taas_magic.export.carry import Carried, ExportError
from taas_magic.export.job import VALUES, job_folder


@dataclass(frozen=True)
class Launch:
    """What the cell's pragma says of how it runs."""

    ranks: int
    device: str  # "cpu" or "cuda"
    restarts: int
    timeout: float | None
    shared: tuple[str, ...]
    cpus: int = 1  # --cpus: the data workers, shared among the ranks here
    units: int | None = None  # --units: elements of each registered loader a run takes in all (None: one pass)
    seed: int = 0  # the job's seed for the loaders' samplers (each pass: seed + pass), fixed at export


def check_plain_python(source: str, cell: int) -> None:
    """The job runs without IPython: a cell that uses IPython's syntax (``%magic``, ``!cmd``) cannot go."""
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Call) and getattr(node.func.value.func, "id", "") == "get_ipython"):
            raise ExportError(f"taas: In[{cell}] line {node.lineno} uses IPython (a %magic or !command), and the job "
                              "runs without it: write that line in Python")


def script_text(path: str, cell: int, source: str, carried: Carried, launch: Launch) -> str:
    name = os.path.basename(path)
    stem = os.path.splitext(name)[0]
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        "#!/usr/bin/env python3",
        f'"""In[{cell}] of a notebook, exported by taas on {when}: {launch.ranks} rank(s) on {launch.device}.',
        "",
        f"Run it: `python {name}` (it starts its {launch.ranks} ranks itself), `torchrun --nproc-per-node "
        f"{launch.ranks}{f' --max-restarts {launch.restarts}' if launch.restarts else ''} {name}`,",
        f"`sbatch {stem}.sbatch` or `python {stem}_ray.py`. It needs torch and taas_magic, not Jupyter. The notebook",
        f"values the cell reads are in {stem}.taas/{VALUES}; rank 0's names land in {stem}.taas/, and",
        f'`taas.load_job("{name}")` binds them in a notebook.',
        '"""',
        "from taas_magic.export import job as _taas_job",
        "",
        f"_taas = _taas_job.start(__file__, ranks={launch.ranks}, device={launch.device!r}, "
        f"restarts={launch.restarts}, timeout={launch.timeout!r}, shared={launch.shared!r})",
        "",
        "# -- what the cell reads of the notebook " + "-" * 70,
    ]
    lines += sorted(set(carried.imports.values()))
    for definition in carried.ordered_definitions():
        lines += ["", f"# In[{definition.cell}]", definition.source.rstrip("\n")]
    if carried.values:
        names = sorted(carried.values)
        target = ", ".join(names) + ("," if len(names) == 1 else "")
        lines += ["", f"{target} = _taas.values({', '.join(repr(n) for n in names)})"]
    for name in carried.loaders:  # as the data workers prepare it: this rank's share of each pass
        lines.append(f"{name} = _taas.feed({name}, cpus={launch.cpus}, units={launch.units!r}, seed={launch.seed}, "
                     f"name={name!r})")
    lines += ["", f"# -- the cell: In[{cell}] " + "-" * 80, "_taas.begin_cell(globals())", source.rstrip("\n"), "",
              "_taas.finish(globals())", ""]
    return "\n".join(lines)


def sbatch_text(path: str, launch: Launch) -> str:
    """Submitted from the folder the notebook ran in (the cell's relative paths are from there), as ``sbatch PATH``."""
    stem = os.path.splitext(path)[0]
    gpus = ["#SBATCH --gpus-per-task=1"] if launch.device == "cuda" else []
    return "\n".join([
        "#!/bin/bash",
        f"# {os.path.basename(path)} as a Slurm job: one task per rank, started by srun (the ranks read Slurm's variables).",
        f"# Submit it from the folder the notebook ran in; the interpreter is the notebook's ({sys.executable}).",
        f"#SBATCH --job-name={os.path.basename(stem)}",
        f"#SBATCH --ntasks={launch.ranks}",
        *gpus,
        f"#SBATCH --output={stem}.taas/slurm-%j.out",
        *([f"#SBATCH --time={max(1, int(launch.timeout // 60) + 1)}"] if launch.timeout else []),
        *_srun_lines(f'srun {shlex.quote(sys.executable)} {shlex.quote(path)} "$@"', launch.restarts),
        "",
    ])


def _srun_lines(srun: str, restarts: int) -> list[str]:
    """The step, started again after a failure up to ``restarts`` times (the attempt in TORCHELASTIC_RESTART_COUNT)."""
    if not restarts:
        return [srun]
    return [f"for attempt in $(seq 0 {restarts}); do",
            "    export TORCHELASTIC_RESTART_COUNT=$attempt",
            f"    {srun} && exit 0",
            f'    echo "taas: the job failed (attempt $attempt of {restarts + 1})" >&2',
            "done",
            "exit 1"]


def ray_text(path: str, launch: Launch) -> str:
    name = os.path.basename(path)
    return "\n".join([
        "#!/usr/bin/env python3",
        f'"""{name} on a Ray cluster: one task per rank (`python {os.path.splitext(name)[0]}_ray.py`, or',
        f'`ray job submit -- python ...`); rank 0\'s output shows here, and its names land beside {name}."""',
        "import os",
        "",
        "from taas_magic.export import launcher",
        "",
        f"launcher.run_on_ray(os.path.join(os.path.dirname(os.path.abspath(__file__)), {name!r}), ranks={launch.ranks}, "
        f"gpus={launch.device == 'cuda'})",
        "",
    ])


def write_job(path: str, cell: int, source: str, carried: Carried, launch: Launch) -> list[str]:
    """All the job's files written, or none changed; the paths written."""
    import torch

    path = os.path.abspath(path)
    stem = os.path.splitext(path)[0]
    folder = job_folder(path)
    texts = {path: script_text(path, cell, source, carried, launch), stem + ".sbatch": sbatch_text(path, launch),
             stem + "_ray.py": ray_text(path, launch)}
    os.makedirs(folder, mode=0o700, exist_ok=True)
    staged: list[tuple[str, str]] = []
    try:
        for target, text in texts.items():
            handle, temporary = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".taas-export-")
            staged.append((temporary, target))
            with os.fdopen(handle, "w") as out:
                out.write(text)
            os.chmod(temporary, 0o755 if target.endswith((".py", ".sbatch")) else 0o644)
        handle, temporary = tempfile.mkstemp(dir=folder, prefix="values-", suffix=".partial.pt")
        os.close(handle)
        staged.append((temporary, os.path.join(folder, VALUES)))
        torch.save(dict(carried.values), temporary)
    except BaseException:
        for temporary, _ in staged:
            if os.path.exists(temporary):
                os.remove(temporary)
        raise
    for temporary, target in staged:
        os.replace(temporary, target)
    return [target for _, target in staged]
