"""``%taas export PATH [In[N]]``: a taas cell of this notebook written as a job (export/carry.py, export/files.py,
export/job.py).

Runs in the kernel, on the cell's thread. The cell is the last taas cell run before this line, or ``In[N]``; it is
prepared as a run of it is, by the same function (cell/prepared.py: its pragma settled against the session's
defaults, ``--gpus auto`` this host's GPUs; its code translated as IPython runs it; its closure); export/carry.py
then decides what of the notebook goes, and export/files.py writes the files, all of them or none.
"""

from __future__ import annotations

import os
import re
import secrets
from typing import Any, Mapping

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from taas_magic.cell.cellcode import translate
from taas_magic.cell.pragma import PragmaOptions, TaasCell, parse_cell
from taas_magic.cell.prepared import prepare
from taas_magic.errors import LaunchError
from taas_magic.export.carry import carry
from taas_magic.export.files import Launch, check_plain_python, write_job
from taas_magic.export.job import VALUES, job_folder
from taas_magic.feed import registry
from taas_magic.launch.rankenv import RankChoice, choose_ranks, visible_gpu_count

_CELL = re.compile(r"^(?:In\[(\d+)\]|(\d+))$")


def export(shell: InteractiveShell, defaults: Mapping[str, object], argument: str) -> None:
    """``%taas export PATH [In[N]]``: the files written, said in one line; or one line saying why not."""
    words = argument.split()
    if not words or len(words) > 2:
        raise UsageError("taas: %taas export PATH [In[N]]: where the job's script goes, and which cell (the last taas "
                         "cell, by default)")
    path = os.path.abspath(os.path.expanduser(words[0]))
    if not path.endswith(".py"):
        raise UsageError(f"taas: the job's script must end in .py, got {words[0]!r}")
    raw = list(getattr(shell.history_manager, "input_hist_raw", []))
    number = _cell_number(raw, words[1] if len(words) > 1 else None)
    prepared = prepare(shell, *_split(raw[number]), defaults, _this_host)
    settings = prepared.settings
    if settings.trials is not None:
        raise UsageError(f"taas: In[{number}] is a search (--trials): export one of its trials' cells instead")
    check_plain_python(prepared.code.source, number)
    try:
        carried = carry(prepared.closure, shell.user_ns, _cells(shell, raw[:number]), registry.registered())
    except LaunchError as exc:
        raise UsageError(str(exc)) from None
    device = "cuda" if settings.device == "cuda" or (settings.device == "auto" and visible_gpu_count() > 0) else "cpu"
    launch = Launch(settings.gpus, device, settings.restarts, settings.timeout, settings.shared, settings.cpus,
                    settings.units, secrets.randbits(31))
    write_job(path, number, prepared.code.source, carried, launch)
    name, stem = os.path.basename(path), os.path.splitext(os.path.basename(path))[0]
    values = os.path.join(os.path.relpath(job_folder(path)), VALUES)
    size = os.path.getsize(os.path.join(job_folder(path), VALUES))
    print(f"taas: In[{number}] exported as {name} ({settings.gpus} rank(s) on {device}: python {name}, or torchrun "
          f"--nproc-per-node {settings.gpus} {name}), {stem}.sbatch and {stem}_ray.py; "
          f"{len(carried.definitions)} definition(s) by source, {len(carried.values)} value(s) in {values} "
          f"({size / 1e6:.1f} MB); taas.load_job({name!r}) brings rank 0's names back")


def _cell_number(raw: list[str], given: str | None) -> int:
    """The cell ``given`` names (``In[N]`` or ``N``), or the last taas cell before this line."""
    if given is not None:
        match = _CELL.match(given)
        if match is None:
            raise UsageError(f"taas: which cell: In[N], got {given!r}")
        number = int(match.group(1) or match.group(2))
        if not 0 < number < len(raw) - 1 or not _is_taas(raw[number]):
            raise UsageError(f"taas: In[{number}] is not a taas cell of this session")
        return number
    for number in range(len(raw) - 2, 0, -1):  # the last one is this line
        if _is_taas(raw[number]):
            return number
    raise UsageError("taas: no taas cell has run in this session yet: run one, then export it")


def _split(text: str) -> tuple[str, str | None]:
    """A taas cell as written, as the magic is given it: (its body, the ``%%taas`` line's arguments), or (the whole
    cell, None) for ``#pragma taas ...`` on top."""
    if text.startswith("%%taas"):
        head, _, body = text.partition("\n")
        return body, head.removeprefix("%%taas").strip() or " "
    return text, None


def _this_host(options: PragmaOptions) -> RankChoice:
    """``--gpus auto``: this host's GPUs (a job runs where it is started; a cluster's job says its own ranks)."""
    return choose_ranks(options.gpus, options.device, visible_gpu_count)


def _is_taas(text: str) -> bool:
    return _taas_cell(text) is not None


def _taas_cell(text: str) -> TaasCell | None:
    """``text`` parsed as a taas cell, or None: not one, or one that does not parse (not exportable)."""
    try:
        return parse_cell(*_split(text))
    except Exception:  # noqa: BLE001 - any reason it does not parse as one
        return None


def _cells(shell: InteractiveShell, raw: list[str]) -> dict[int, str]:
    """The cells before the exported one as Python (a taas cell: its code without its pragma), by number."""
    cells: dict[int, str] = {}
    for number, text in enumerate(raw):
        if not number or not text:
            continue
        try:
            parsed = _taas_cell(text)
            source: Any = parsed.source if parsed is not None else text
            cells[number] = translate(shell, source).source
        except Exception:  # noqa: BLE001 - a cell IPython could not translate defines nothing here
            continue
    return cells
