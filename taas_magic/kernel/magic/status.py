"""The text a person reads: ``%taas help`` around the commands' rows, ``%taas status`` and ``%taas runs``.

Runs in the kernel, on the cell's thread.
"""

from __future__ import annotations

import time
from typing import Sequence

from taas_magic.cell.options import OPTIONS
from taas_magic.errors import describe_exit
from taas_magic.kernel.runs.rankset import RankSet, RankState
from taas_magic.kernel.runs.summary import LastRun, RunSummary, devices_text, started_text


def _columns(rows: Sequence[tuple[str, str]]) -> str:
    width = max(len(left) for left, _ in rows) + 2
    return "\n".join(f"  {left:<{width}}{right}" for left, right in rows)


_HELP_HEAD = f"""\
taas: run one notebook cell as N DDP ranks.

  #!<config>                   optional config lines (e.g. #!g2.8), recorded and shown
  #pragma taas --gpus N        first line of the cell (or: %%taas --gpus N)

Options:
{_columns([(option.signature, option.help) for option in OPTIONS])}

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
MASTER_PORT and TORCHELASTIC_RUN_ID, so init_process_group(init_method='env://') and
Lightning's Trainer(strategy="ddp") work unchanged. Rank 0's new or changed names come
back to the notebook; its last expression becomes the cell's result.

Only rank 0 writes to the repository (the git work tree holding the working directory):
the other ranks' writes there are diverted to a private layer, thrown away after the cell.

"""


def help_text(commands: Sequence[tuple[str, str]]) -> str:
    """``%taas help``: the options (cell/options.py's table), then ``commands``, (usage, what it does)
    rows (kernel/magic/commands.py's table)."""
    return _HELP_HEAD + _columns(commands)


def status_text(last: LastRun | None, gpus_seen: int, defaults: Sequence[tuple[str, object]],
                registered: Sequence[str] = ()) -> str:
    """``defaults``: each option's session default, by flag (options.shown_defaults)."""
    lines = [f"devices seen: {gpus_seen} GPU(s)" if gpus_seen else "devices seen: no GPU (ranks run on CPU with gloo)"]
    lines.append("defaults: " + ", ".join(f"{flag} {value}" for flag, value in defaults))
    lines.append("registered loaders: " + ("; ".join(registered) or "none (taas.register(loader) adds one)"))
    if last is None:
        lines.append("last run: none yet")
    else:
        settings = last.settings
        lines.append(
            f"last run: {last.run_id}, --gpus {settings.gpus}, {devices_text(last.devices, settings.gpus)}, "
            f"{last.seconds:.2f} s, {last.outcome}"
        )
        if settings.configs:
            lines.append("  config: " + ", ".join(settings.configs))
        lines.append("  names sent: " + (", ".join(last.closure_names) or "none"))
    return "\n".join(lines)


def _state(summary: RunSummary) -> str:
    if summary.state == "running":
        return "running (detached)" if summary.detached else "running"
    if summary.taken or not summary.detached:
        return summary.state
    return f"{summary.state}, not taken (%taas wait {summary.run_id})"


def runs_table(summaries: Sequence[RunSummary]) -> str:
    """``%taas runs``: one row per run of this kernel, oldest first."""
    if not summaries:
        return "taas: no run in this kernel yet"
    rows = [("run", "state", "ranks", "started", "last line")]
    rows += [(s.run_id, _state(s), str(s.ranks), started_text(s), s.last_line[-60:]) for s in summaries]
    widths = [max(len(row[column]) for row in rows) for column in range(4)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[4]
                     for row in rows).rstrip()


def kept_lines(kept: RankSet) -> list[str]:
    """What ``%taas status`` and ``%taas runs`` say of the kept ranks: their state, shape, cells, and each rank's
    memory at the end of its last cell."""
    if not kept.running:
        why = kept.ranks.ended_why() or "not started"
        return [f"kept ranks: {kept.state.value}, none running ({kept.shape}; {why})"]
    idle = f"busy with run {kept.busy_with}" if kept.state is RankState.BUSY else "idle"
    since = time.strftime("%H:%M:%S", time.localtime(kept.started))
    lines = [f"kept ranks: {kept.shape}, {kept.cells} cell(s) since {since}, {idle} (%taas release ends them)"]
    assert kept.ranks.group is not None
    dead = kept.ranks.dead()
    for child in kept.ranks.group.children:
        if child.index in dead:
            lines.append(f"  rank {child.index} on {child.host} {describe_exit(dead[child.index])}: the next --keep "
                         "cell starts a new process in its place")
            continue
        figures = kept.health.get(child.index, {})
        memory = [f"{figures['rss'] / 2**20:.0f} MiB host"] if "rss" in figures else []
        if "gpu_memory" in figures:
            memory.append(f"{figures['gpu_memory'] / 2**20:.0f} MiB on GPU {figures.get('gpu', '?')}")
        process = f"pid {figures['pid']} on {child.host}" if "pid" in figures else f"on {child.host}"
        lines.append(f"  rank {child.index}, {process} ({kept.shape.device}): {', '.join(memory) or 'memory not reported yet'}")
    return lines + [f"  {line}" for line in kept.ranks.replaced]
