"""Slurm's own commands, run and read: the only place taas speaks to Slurm besides ``salloc`` and ``srun``.

Runs in the kernel, on the thread that asks: the cell's (the allocation and its queue) or the run's
own (a step's nodes and their state).

Nothing here needs an accounting database: job and node state come from the controller
(``squeue``, ``scontrol``, ``sinfo``). Every command runs with :func:`command_env`: the
kernel's environment without the ``SLURM_*`` variables of a job the kernel may itself run
inside (``srun`` and ``salloc`` read ``SLURM_NTASKS`` and the like as options), ``SLURM_CONF`` kept.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable

from taas_magic.errors import ClusterError

TOOLS = ("salloc", "srun", "squeue", "scontrol", "scancel", "sinfo")
KEPT = ("SLURM_CONF",)  # where the cluster's configuration is: every command needs it


def missing() -> str | None:
    """Why Slurm's commands cannot be used from this host, or None."""
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return f"Slurm's commands are not on this host's PATH ({', '.join(absent)} not found)"
    return None


def command_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for name in [name for name in env if name.startswith(("SLURM_", "SALLOC_", "SRUN_", "SBATCH_"))]:
        if name not in KEPT:
            del env[name]
    return env


def run(*command: str, timeout: float = 30, check: bool = True) -> str:
    """A Slurm command's output; raises ClusterError with Slurm's own message when it fails."""
    try:
        done = subprocess.run(command, env=command_env(), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        if not check:
            return ""  # a look that can wait for the next one (the queue display, node states)
        raise ClusterError(f"taas: {command[0]} did not answer ({exc})") from None
    if check and done.returncode != 0:
        said = done.stderr.strip().splitlines()
        raise ClusterError(f"taas: {' '.join(command[:3])} failed: {said[-1] if said else f'exit {done.returncode}'}")
    return done.stdout


def hostnames(nodelist: str) -> list[str]:
    """``node[1-3],gpu7`` as Slurm expands it."""
    if not nodelist or nodelist in ("(null)", "None"):
        return []
    return run("scontrol", "show", "hostnames", nodelist).split()


@dataclass(frozen=True)
class JobInfo:
    """One job as ``scontrol show job -d`` reports it."""

    job_id: str
    state: str  # PENDING, RUNNING, COMPLETING, CANCELLED, ...
    reason: str
    nodes: tuple[str, ...]  # its nodes, in Slurm's order (empty while pending)
    gpus: dict[str, int]  # GPUs it holds on each node
    cpus: dict[str, int]  # CPUs it holds on each node
    partition: str
    time_limit: str

    @property
    def gpus_total(self) -> int:
        return sum(self.gpus.values())


_FIELD = re.compile(r"(\w[\w:/]*)=(\S*)")
_GRES_GPU = re.compile(r"gpu(?::[^:(,]+)?:(\d+)")
_CPU_IDS = re.compile(r"CPU_IDs=(\S+)")


def _count_ids(ids: str) -> int:
    count = 0
    for part in ids.split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            count += int(high) - int(low) + 1 if high.isdigit() else 1
    return count


def show_job(job_id: str) -> JobInfo | None:
    """The job, or None once the controller no longer knows it."""
    out = run("scontrol", "show", "job", "-d", job_id, check=False)
    if not out.strip() or "Invalid job id" in out:
        return None
    return parse_job(job_id, out, hostnames)


def parse_job(job_id: str, out: str, expand: Callable[[str], list[str]]) -> JobInfo:
    """``scontrol show job -d``'s text; ``expand`` turns a node list (``node[1-2]``) into names."""
    fields = dict(_FIELD.findall(out))
    gpus: dict[str, int] = {}
    cpus: dict[str, int] = {}
    for line in out.splitlines():
        line = line.strip()
        if not line.startswith("Nodes="):
            continue
        names = expand(line.split()[0].removeprefix("Nodes="))
        gres = line.partition("GRES=")[2]
        per_node = sum(int(count) for count in _GRES_GPU.findall(gres))
        cpu_ids = _CPU_IDS.search(line)
        for name in names:
            gpus[name] = gpus.get(name, 0) + per_node
            cpus[name] = cpus.get(name, 0) + (_count_ids(cpu_ids.group(1)) if cpu_ids else 0)
    nodes = tuple(expand(fields.get("NodeList", "")))
    return JobInfo(job_id, fields.get("JobState", "UNKNOWN"), fields.get("Reason", "None"), nodes,
                   {node: gpus.get(node, 0) for node in nodes}, {node: cpus.get(node, 0) for node in nodes},
                   fields.get("Partition", ""), fields.get("TimeLimit", ""))


def time_left(job_id: str) -> str:
    """``squeue``'s time left (``D-HH:MM:SS``, or ``UNLIMITED``)."""
    return run("squeue", "-h", "-j", job_id, "-o", "%L", check=False).strip() or "?"


def queue_position(job_id: str, partition: str) -> tuple[int, int] | None:
    """Where the pending job stands among its partition's pending jobs (1-based), and how many wait."""
    out = run("squeue", "-h", "-t", "PENDING", "-p", partition, "--sort=-p,i", "-o", "%i", check=False) if partition else ""
    pending = out.split()
    if job_id not in pending:
        return None
    return pending.index(job_id) + 1, len(pending)


def node_states(names: list[str]) -> dict[str, str]:
    """Each node's state as the controller sees it (``idle``, ``mixed``, ``down*``, ...)."""
    if not names:
        return {}
    out = run("sinfo", "-h", "-N", "-n", ",".join(names), "-o", "%N %T", check=False)
    states: dict[str, str] = {}
    for line in out.splitlines():
        name, _, state = line.partition(" ")
        states[name] = state.strip().lower()
    return states


def node_address(name: str) -> str:
    """The address Slurm reaches node ``name`` at (its NodeAddr)."""
    fields = dict(_FIELD.findall(run("scontrol", "show", "node", name, check=False)))
    return fields.get("NodeAddr", name)


def cancel(target: str, signal: str | None = None) -> None:
    """``scancel`` a job or a step (``JOB.STEP``); with ``signal``, only signal it, at once (``--full``
    for a job's batch shell too). What is already gone is not an error."""
    command = ["scancel", "--quiet"]
    if signal is not None:
        command.append(f"--signal={signal}")
    run(*command, target, check=False)
