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
from taas_magic.launch.slurm.task import COMMAND, StepChannels

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


class SlurmStep:
    """The ranks (or data workers) of one attempt: one srun step, one task each."""

    def __init__(self, srun: subprocess.Popen, hub: OutputHub):
        self._srun = srun
        self._hub = hub
        self.children: list[SlurmChild] = []
        self.hellos: list[dict] = []
        self.step = ""
        self._commands: dict[int, socket.socket] = {}
        self._said: deque[str] = deque(maxlen=20)
        self._silent: set[int] = set()  # tasks whose command channel closed before they were told to end
        self._closed = False
        threading.Thread(target=self._read_srun, name="taas-srun", daemon=True).start()

    @classmethod
    def start(cls, job_id: str, plan: LaunchPlan, key: bytes, listen_host: str, *, gpus: bool,
              exclude: Sequence[str] = (), command: tuple[str, ...] | None = None,
              dirs: tuple[str, ...] = ()) -> "SlurmStep":
        """Run ``plan``'s processes as the tasks of one step; return once every one is started and connected."""
        count = plan.world_size
        channels = StepChannels(count)
        hub = OutputHub(listen_host, key, len(channels))
        srun_command = ["srun", f"--jobid={job_id}", f"--ntasks={count}", "--input=all", "--kill-on-bad-exit=0", "--quiet"]
        if gpus:
            srun_command.append("--gpus-per-task=1")  # steps side by side (a search's trials) get GPUs of their own
        else:
            srun_command += ["--gres=none", "--overlap"]  # data workers share the CPUs with the ranks' step
        if exclude:
            srun_command.append(f"--exclude={','.join(sorted(exclude))}")
        srun = subprocess.Popen([*srun_command, *COMMAND], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=slurmcli.command_env(),
                                cwd=plan.cwd, start_new_session=True, close_fds=True)
        step = cls(srun, hub)
        try:
            assert srun.stdin is not None
            srun.stdin.write(hub.handshake.line().encode() + b"\n")
            srun.stdin.flush()
            deadline = time.monotonic() + START_PATIENCE
            step._collect(deadline, [channels.command(task) for task in range(count)])
            step._hellos(count, deadline)
            step._send_plans(plan, gpus, command, dirs)
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
    def _read_srun(self) -> None:
        assert self._srun.stdout is not None
        for raw in self._srun.stdout:
            self._said.append(raw.decode(errors="replace").rstrip())

    def said(self) -> str:
        """What srun (and Slurm through it) said last, for an error."""
        return "; ".join(line.removeprefix("srun: ").strip() for line in list(self._said)[-3:]) or "nothing"

    def _collect(self, deadline: float, wanted: list[int]) -> None:
        """Accept connections until the channels ``wanted`` are connected (each proves the run's key)."""
        hub = self._hub
        while any(channel not in hub.connected for channel in wanted):
            if self._srun.poll() is not None:
                time.sleep(0.1)  # its last words
                raise LaunchError(f"taas: the srun step ended before its tasks connected (exit {self._srun.returncode}): "
                                  f"{self.said()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"taas: the step's tasks did not connect to the kernel within {START_PATIENCE:g} s "
                                  f"(is this host's address {hub.address[0]} reachable from the nodes? "
                                  "TAAS_SLURM_ADDRESS sets it); srun said: " + self.said())
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

    def _send_plans(self, plan: LaunchPlan, gpus: bool, command: tuple[str, ...] | None, dirs: tuple[str, ...]) -> None:
        """Each task's rank plan, with torchrun's variables from Slurm's placement."""
        first = self.hellos[0]
        on_node: dict[str, list[dict]] = {}
        for hello in self.hellos:
            on_node.setdefault(hello["node"], []).append(hello)
        for hello in self.hellos:
            task, node_tasks = hello["task"], sorted(on_node[hello["node"]], key=lambda h: h["local"])
            env = dict(plan.envs[task])
            env.update(RANK=str(task), LOCAL_RANK=str(hello["local"]), WORLD_SIZE=str(hello["tasks"]),
                       LOCAL_WORLD_SIZE=str(len(node_tasks)), GROUP_RANK=str(hello["node_index"]),
                       ROLE_RANK=str(task), ROLE_WORLD_SIZE=str(hello["tasks"]),
                       MASTER_ADDR=first["address"], MASTER_PORT=str(first["master_port"] or env.get("MASTER_PORT", "")))
            visible = ",".join(h["gpus"] for h in node_tasks if h["gpus"]) if gpus else None
            message = {"env": env, "cwd": plan.cwd, "handshake": plan.handshake, "place": plan.places[task].line(),
                       "stack_file": plan.stack_files[task] if task < len(plan.stack_files) else None,
                       "visible": visible, "command": list(command) if command else None, "dirs": list(dirs)}
            self._commands[task].sendall(json.dumps(message).encode() + b"\n")

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
            assert self._srun.stdin is not None
            try:
                self._srun.stdin.close()  # every task's lifeline
            except OSError:
                pass
            self._end_step()
        finally:
            self._hub.close()

    def _end_step(self) -> None:
        """srun ends once its tasks have; a step still there after a grace is killed, never left to KillWait."""
        try:
            self._srun.wait(END_GRACE)
        except subprocess.TimeoutExpired:
            if self.step:
                slurmcli.cancel(self.step, signal="KILL")
            try:
                self._srun.wait(END_GRACE)
            except subprocess.TimeoutExpired:
                self._srun.kill()
                self._srun.wait()


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

