"""One attempt's ranks as one ``srun`` step in the held allocation.

``srun --jobid=J --ntasks=N [--gpus-per-task=1] --input=all python -m taas_magic.launch.slurm.task``:
Slurm places the N tasks across the allocation's nodes and binds each its GPU; each task
(launch/slurm/task.py) connects to this step's output hub with the run's key and says where
it is. From those answers the kernel makes each rank's plan: ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` are Slurm's ``SLURM_PROCID``,
``SLURM_LOCALID``, ``SLURM_NTASKS``, the tasks on the node and ``SLURM_NODEID``;
``MASTER_ADDR`` is task 0's node (the address the kernel reached it from) and
``MASTER_PORT`` a port task 0 reserved there; ``CUDA_VISIBLE_DEVICES`` lists, in local-task
order, the GPUs Slurm bound to the node's tasks, so ``cuda:LOCAL_RANK`` is exactly the GPU
Slurm gave the rank (never a local rank written over Slurm's binding).

The supervisor then sees a :class:`SlurmStep` as it sees a local group: each rank's output
(a hub channel each, bytes unchanged), exit codes (sent after the output), ``stop``,
``stacks`` and ``close``. Closing tells each task to end, then, if the step is still there
after a short grace, kills it (``scancel --signal=KILL``), so nothing waits on Slurm's ``KillWait``.
"""

from __future__ import annotations

import json
import select
import socket
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Sequence

from taas_magic.errors import LaunchError
from taas_magic.launch.base import LaunchPlan
from taas_magic.launch.ray import HostControl, OutputHub
from taas_magic.launch.slurm import slurmcli
from taas_magic.launch.slurm.task import COMMAND
from taas_magic.peers import StepChannels

START_PATIENCE = 120.0  # seconds for Slurm to start the step's tasks and each to connect
COMMAND_PATIENCE = 10.0  # seconds a task may take to answer a stop
AUTOPSY_PATIENCE = 1.5  # seconds for the tasks to return their ranks' stacks (each takes at most 1 s)
END_GRACE = 2.0  # seconds the tasks have to end by themselves before the step is killed


@dataclass
class SlurmChild:
    """One rank of the step, read as the supervisor reads a local one."""

    index: int
    node: str
    stdout_fd: int
    stderr_fd: int
    control: HostControl  # its task's exit channel
    exit_fd: int | None = None  # exit codes arrive on the exit channel, polled

    @property
    def host(self) -> str:
        """Its node, and whether the node went away (its task vanished without reporting the rank's exit)."""
        if self.control.lost and 0 not in self.control.codes:
            return f"{self.node} (lost: its task vanished without a word; the node or its slurmd went away)"
        return self.node

    def poll(self) -> int | None:
        return self.control.poll(0)


@dataclass(frozen=True)
class StepTarget:
    """Where a step goes: the allocation's job, this kernel's address the tasks connect back to,
    whether each task takes a GPU, and the nodes left out (found lost)."""

    job_id: str
    listen_host: str
    gpus: bool
    exclude: tuple[str, ...] = ()

    def srun(self, count: int) -> list[str]:
        command = ["srun", f"--jobid={self.job_id}", f"--ntasks={count}", "--input=all", "--kill-on-bad-exit=0", "--quiet"]
        if self.gpus:
            command.append("--gpus-per-task=1")  # steps side by side (a search's trials) get GPUs of their own
        else:
            command += ["--gres=none", "--overlap"]  # data workers share the CPUs with the ranks' step
        if self.exclude:
            command.append(f"--exclude={','.join(sorted(self.exclude))}")
        return [*command, *COMMAND]


class Srun:
    """The step's srun on this host: its stdin (every task's lifeline) and its last words."""

    def __init__(self, command: list[str], cwd: str):
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        env=slurmcli.command_env(), cwd=cwd, start_new_session=True, close_fds=True)
        self._said: deque[str] = deque(maxlen=20)
        threading.Thread(target=self._read, name="taas-srun", daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self._said.append(raw.decode(errors="replace").rstrip())

    def said(self) -> str:
        """What srun (and Slurm through it) said last, for an error."""
        return "; ".join(line.removeprefix("srun: ").strip() for line in list(self._said)[-3:]) or "nothing"

    def tell_tasks(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line.encode() + b"\n")
        self.process.stdin.flush()

    def end(self, step: str) -> None:
        """Every task's lifeline closed; srun ends once its tasks have, and a step still there after
        a grace is killed (never left to Slurm's KillWait)."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(END_GRACE)
        except subprocess.TimeoutExpired:
            if step:
                slurmcli.cancel(step, signal="KILL")
            try:
                self.process.wait(END_GRACE)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def rank_plans(hellos: list[dict], plan: LaunchPlan, gpus: bool, command: tuple[str, ...] | None,
               dirs: tuple[str, ...]) -> list[dict]:
    """Each task's rank plan (by task), torchrun's variables from where Slurm put the tasks."""
    first = hellos[0]
    on_node: dict[str, list[dict]] = {}
    for hello in hellos:
        on_node.setdefault(hello["node"], []).append(hello)
    plans = []
    for hello in hellos:
        task, node_tasks = hello["task"], sorted(on_node[hello["node"]], key=lambda h: h["local"])
        env = dict(plan.envs[task])
        env.update(RANK=str(task), LOCAL_RANK=str(hello["local"]), WORLD_SIZE=str(hello["tasks"]),
                   LOCAL_WORLD_SIZE=str(len(node_tasks)), GROUP_RANK=str(hello["node_index"]),
                   ROLE_RANK=str(task), ROLE_WORLD_SIZE=str(hello["tasks"]),
                   MASTER_ADDR=first["address"], MASTER_PORT=str(first["master_port"] or env.get("MASTER_PORT", "")))
        visible = ",".join(h["gpus"] for h in node_tasks if h["gpus"]) if gpus else None
        plans.append({"env": env, "cwd": plan.cwd, "handshake": plan.handshake, "place": plan.places[task].line(),
                      "stack_file": plan.stack_files[task] if task < len(plan.stack_files) else None,
                      "visible": visible, "command": list(command) if command else None, "dirs": list(dirs)})
    return plans


class SlurmStep:
    """The ranks (or data workers) of one attempt: one srun step, one task each."""

    def __init__(self, srun: Srun, hub: OutputHub):
        self._srun = srun
        self._hub = hub
        self.children: list[SlurmChild] = []
        self.hellos: list[dict] = []
        self.step = ""
        self._commands: dict[int, socket.socket] = {}
        self._silent: set[int] = set()  # tasks whose command channel closed before they were told to end
        self._closed = False

    @classmethod
    def start(cls, target: StepTarget, plan: LaunchPlan, key: bytes, command: tuple[str, ...] | None = None,
              dirs: tuple[str, ...] = ()) -> "SlurmStep":
        """Run ``plan``'s processes (``command``: data workers, not ranks) as the tasks of one step;
        return once every one is started and connected."""
        count = plan.world_size
        channels = StepChannels(count)
        hub = OutputHub(target.listen_host, key, len(channels))
        step = cls(Srun(target.srun(count), plan.cwd), hub)
        try:
            step._srun.tell_tasks(hub.handshake.line())
            deadline = time.monotonic() + START_PATIENCE
            step._collect(deadline, [channels.command(task) for task in range(count)])
            step._hellos(count, deadline)
            for task, rank_plan in enumerate(rank_plans(step.hellos, plan, target.gpus, command, dirs)):
                step._commands[task].sendall(json.dumps(rank_plan).encode() + b"\n")
            step._collect(deadline, list(range(len(channels))))
            for hello in step.hellos:
                task = hello["task"]
                control = HostControl(hub.connected[channels.exits(task)], hello["node"])
                step.children.append(SlurmChild(task, hello["node"], hub.connected[channels.stream(task, "stdout")].fileno(),
                                                hub.connected[channels.stream(task, "stderr")].fileno(), control))
        except BaseException:
            step.close()
            raise
        return step

    # -- starting ---------------------------------------------------------------------------
    def _collect(self, deadline: float, wanted: list[int]) -> None:
        """Accept connections until the channels ``wanted`` are connected (each proves the run's key)."""
        hub = self._hub
        while any(channel not in hub.connected for channel in wanted):
            if self._srun.process.poll() is not None:
                time.sleep(0.1)  # its last words
                raise LaunchError(f"taas: the srun step ended before its tasks connected "
                                  f"(exit {self._srun.process.returncode}): {self._srun.said()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"taas: the step's tasks did not connect to the kernel within {START_PATIENCE:g} s "
                                  f"(is this host's address {hub.address[0]} reachable from the nodes? "
                                  "TAAS_SLURM_ADDRESS sets it); srun said: " + self._srun.said())
            ready, _, _ = select.select([hub.listener], [], [], min(left, 0.05))
            if ready:
                hub._accept_one(deadline)

    def _hellos(self, count: int, deadline: float) -> None:
        channels = StepChannels(count)
        for task in range(count):
            sock = self._hub.connected[channels.command(task)]
            self._commands[task] = sock
            self.hellos.append(json.loads(_read_line(sock, deadline)))
        self.hellos.sort(key=lambda hello: hello["task"])
        self.step = self.hellos[0]["step"]

    # -- the supervisor's contract ------------------------------------------------------------
    def nodes(self) -> list[str]:
        """Each rank's node, by rank."""
        return [hello["node"] for hello in self.hellos]

    def vanished_nodes(self) -> list[str]:
        """Nodes whose every task went away unasked (its command channel closed without ``end``):
        a task outlives its rank and answers for it, so a silent task means its node is gone."""
        silent: dict[str, bool] = {}
        for hello in self.hellos:
            silent[hello["node"]] = silent.get(hello["node"], True) and hello["task"] in self._silent
        return [node for node, gone in silent.items() if gone]

    def _ask(self, tasks: Sequence[int], message: dict, patience: float) -> dict[int, dict]:
        """Send ``message`` to those tasks, then read their answers until ``patience`` passes."""
        asked: dict[int, socket.socket] = {}
        for task in tasks:
            sock = self._commands.get(task)
            if sock is None:
                continue
            try:
                sock.sendall(json.dumps(message).encode() + b"\n")
                asked[task] = sock
            except OSError:
                self._silent.add(task)
                continue
        deadline = time.monotonic() + patience
        answers: dict[int, dict] = {}
        for task, sock in asked.items():
            try:
                answers[task] = json.loads(_read_line(sock, deadline))
            except (ConnectionError, ValueError):
                self._silent.add(task)  # it died (its node, most likely): close() kills what is left of the step
            except (OSError, TimeoutError):
                continue  # it hangs: close() kills the step
        return answers

    def stop(self, graceful: bool = True) -> list[str]:
        signals: list[str] = []
        for answer in self._ask(list(self._commands), {"do": "stop", "graceful": graceful}, COMMAND_PATIENCE).values():
            signals += [name for name in answer.get("signals", []) if name not in signals]
        return signals

    def stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        found: dict[int, str] = {}
        for answer in self._ask([rank for rank in ranks if rank in self._commands], {"do": "stacks", "ranks": list(ranks)},
                                AUTOPSY_PATIENCE).values():
            found.update({int(rank): text for rank, text in answer.get("stacks", {}).items()})
        return found

    def __enter__(self) -> "SlurmStep":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Every task told to end (each stops and reaps its rank); the step killed if it is still there after a grace."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ask(list(self._commands), {"do": "end"}, COMMAND_PATIENCE)
            self._srun.end(self.step)
        finally:
            self._hub.close()


def _read_line(sock: socket.socket, deadline: float) -> str:
    """One line from a task's command channel (a line is all a task sends before it waits for
    the next command), waiting no later than ``deadline``."""
    data = bytearray()
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no answer")
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            continue
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data.decode()

