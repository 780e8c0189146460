"""One attempt's ranks as one ``srun`` step in the held allocation.

Runs in the kernel, on the run's own thread; ``srun``'s own output is read on a helper thread
(``taas-srun``).

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
import os
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from types import TracebackType
from typing import Callable, Sequence

from taas_magic.errors import LaunchError
from taas_magic.launch.contract import ChildProcess, LaunchPlan
from taas_magic.launch.hosts.outputhub import HostControl, OutputHub
from taas_magic.launch.slurm import slurmcli
from taas_magic.launch.slurm.task import COMMAND
from taas_magic.launch.slurm.taskcommands import TaskCommands
from taas_magic.peers import STREAMS, StepChannels

START_PATIENCE = 120.0  # seconds for Slurm to start the step's tasks and each to connect
COMMAND_PATIENCE = 10.0  # seconds a task may take to answer a stop (its ladder takes at most 4.5 s)
END_PATIENCE = 20.0  # seconds a task may take to end: the ladder, then its pumps' and reporter's joins
AUTOPSY_PATIENCE = 1.5  # seconds for the tasks to return their ranks' stacks (each takes at most 1 s)
END_GRACE = 2.0  # seconds the tasks have to end by themselves before the step is killed
VANISHED_GRACE = 2.0  # seconds after srun ended that a rank with no exit code counts as killed


@dataclass
class SlurmChild:
    """One rank of the step, read as the supervisor reads a local one."""

    index: int
    node: str
    stdout_fd: int
    stderr_fd: int
    control: HostControl  # its task's exit channel
    srun_ended: Callable[[], float | None]  # how long ago the step's srun ended, or None
    srun_said: Callable[[], str]  # srun's last lines: Slurm's, and what the tasks printed
    exit_fd: int | None = None  # exit codes arrive on the exit channel, polled

    @property
    def host(self) -> str:
        """Its node, and whether its task vanished without reporting the rank's exit (the node, its
        slurmd or the step went away)."""
        if self.control.lost and 0 not in self.control.codes:
            return (f"{self.node} (its task ended without reporting the rank's exit: the node, its slurmd or the step "
                    f"went away; srun said: {self.srun_said()})")
        return self.node

    def poll(self) -> int | None:
        code = self.control.poll(0)
        if code is None:
            ended = self.srun_ended()
            if ended is not None and ended > VANISHED_GRACE:
                return -9  # the step is over and this rank never said so: its node is unreachable
        return code


@dataclass(frozen=True)
class StepTarget:
    """Where a step goes: the allocation's job, this kernel's address the tasks connect back to,
    whether each task takes a GPU, the fewest nodes the tasks fit on (so Slurm packs them rather
    than spreading one per node), each task's CPUs, and the nodes left out (found lost)."""

    job_id: str
    listen_host: str
    gpus: bool
    nodes: int | None = None
    cpus_per_task: int = 1
    exclude: tuple[str, ...] = ()

    def srun(self, count: int) -> list[str]:
        command = ["srun", f"--jobid={self.job_id}", f"--ntasks={count}", "--input=all", "--kill-on-bad-exit=0",
                   f"--cpus-per-task={self.cpus_per_task}"]
        if self.nodes is not None:
            command.append(f"--nodes={self.nodes}")
        if self.gpus:
            command.append("--gpus-per-task=1")  # steps side by side (a search's trials) get GPUs of their own
        else:
            command += ["--gres=none", "--overlap"]  # data workers share the CPUs with the ranks' step
        if self.exclude:
            command.append(f"--exclude={','.join(sorted(self.exclude))}")
        return [*command, *COMMAND]


def fewest_nodes(capacity: Sequence[int], count: int) -> int | None:
    """The fewest of nodes with these capacities (GPUs, or CPUs) that hold ``count`` tasks."""
    held = 0
    for used, have in enumerate(sorted(capacity, reverse=True), 1):
        held += have
        if held >= count:
            return used
    return None


class Srun:
    """The step's srun on this host: its stdin (every task's lifeline), its last words, when it ended."""

    def __init__(self, command: list[str], cwd: str):
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        env=slurmcli.command_env(), cwd=cwd, start_new_session=True, close_fds=True)
        self._said: deque[str] = deque(maxlen=20)
        self._ended_at: float | None = None
        self._reader = threading.Thread(target=self._read, name="taas-srun", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self._said.append(raw.decode(errors="replace").rstrip())

    def said(self) -> str:
        """What srun (and Slurm through it) said last, for an error."""
        return "; ".join(line.removeprefix("srun: ").strip() for line in list(self._said)[-3:]) or "nothing"

    def ended(self) -> float | None:
        """Seconds since srun was first seen ended (None: it runs)."""
        if self._ended_at is None and self.process.poll() is not None:
            self._ended_at = time.monotonic()
        return None if self._ended_at is None else time.monotonic() - self._ended_at

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
        self._reader.join(timeout=1)
        assert self.process.stdout is not None
        self.process.stdout.close()


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
                      "visible": visible, "command": list(command) if command else None, "dirs": list(dirs),
                      "threads": os.environ.get("OMP_NUM_THREADS")})  # the person's, else the task's CPUs
    return plans


class SlurmStep:
    """The ranks (or data workers) of one attempt: one srun step, one task each."""

    def __init__(self, hub: OutputHub):
        self._hub = hub
        self._srun: Srun | None = None
        self.children: list[SlurmChild] = []
        self.hellos: list[dict] = []
        self.step = ""
        self._tasks = TaskCommands()
        self._closed = False
        self._gpus = False  # one GPU per task (its target's)

    @classmethod
    def start(cls, target: StepTarget, plan: LaunchPlan, key: bytes, command: tuple[str, ...] | None = None,
              dirs: tuple[str, ...] = (), stop_asked: Callable[[], bool] = lambda: False) -> "SlurmStep":
        """Run ``plan``'s processes (``command``: data workers, not ranks) as the tasks of one step;
        return once every one is started and connected (``stop_asked``: an interrupt meanwhile)."""
        count = plan.world_size
        channels = StepChannels(count)
        step = cls(OutputHub(target.listen_host, key, len(channels)))
        try:
            step._srun = srun = Srun(target.srun(count), plan.cwd)
            step._gpus = target.gpus
            srun.tell_tasks(step._hub.handshake.line())
            deadline = time.monotonic() + START_PATIENCE
            step._collect(deadline, [channels.command(task) for task in range(count)], stop_asked)
            step.hellos = step._tasks.greet([step._hub.connected[channels.command(task)] for task in range(count)],
                                            deadline, srun.said)
            step.step = step.hellos[0]["step"]
            for task, rank_plan in enumerate(rank_plans(step.hellos, plan, target.gpus, command, dirs)):
                step._tasks.sockets[task].sendall(json.dumps(rank_plan).encode() + b"\n")
            step._collect(deadline, list(range(len(channels))), stop_asked)
            hub = step._hub.connected
            for hello in step.hellos:
                task = hello["task"]
                step.children.append(SlurmChild(task, hello["node"], hub[channels.stream(task, "stdout")].fileno(),
                                                hub[channels.stream(task, "stderr")].fileno(),
                                                HostControl(hub[channels.exits(task)], hello["node"]), srun.ended, srun.said))
        except BaseException:
            step.close()
            raise
        return step

    # -- starting ---------------------------------------------------------------------------
    def _collect(self, deadline: float, wanted: list[int], stop_asked: Callable[[], bool]) -> None:
        """Accept connections until the channels ``wanted`` are connected (each proves the run's key);
        a task that fails to start its rank, or srun ending, fails the start at once."""
        hub, srun = self._hub, self._srun
        assert srun is not None

        def starting() -> None:
            if stop_asked():
                raise KeyboardInterrupt  # as the person's interrupt, while Slurm starts the step
            if srun.process.poll() is not None:
                time.sleep(0.1)  # its last words
                raise LaunchError(f"taas: the srun step ended before its tasks connected "
                                  f"(exit {srun.process.returncode}): {srun.said()}")
            self._tasks.started(self.hellos)

        hub.accept(deadline, wanted, starting, lambda missing: (
            f"taas: the step's tasks did not connect to the kernel within {START_PATIENCE:g} s (is this host's address "
            f"{hub.address[0]} reachable from the nodes? TAAS_SLURM_ADDRESS sets it); srun said: " + srun.said()))

    # -- the supervisor's contract ------------------------------------------------------------
    def nodes(self) -> list[str]:
        """Each rank's node, by rank."""
        return [hello["node"] for hello in self.hellos]

    def vanished_nodes(self) -> list[str]:
        """Nodes whose every task went away unasked while tasks elsewhere still answered: a task
        outlives its rank and answers for it, so that node is gone. (When every task went silent,
        the step as a whole ended: no node is blamed; the controller's view decides.)"""
        silent: dict[str, bool] = {}
        for hello in self.hellos:
            silent[hello["node"]] = silent.get(hello["node"], True) and hello["task"] in self._tasks.silent
        gone = [node for node, quiet in silent.items() if quiet]
        return gone if len(gone) < len(silent) else []

    def ask(self, task: int, message: dict, patience: float) -> dict | None:
        """One task's answer to ``message`` (None: it did not answer in time, or is gone)."""
        return self._tasks.ask([task], message, patience).get(task)

    def interrupt(self, ranks: Sequence[int]) -> None:
        """Each of those ranks' tasks signals it (one task per rank); one that does not answer is stopped later."""
        self._tasks.ask(list(ranks), {"do": "interrupt", "ranks": list(ranks)}, COMMAND_PATIENCE)

    def stop(self, graceful: bool = True) -> list[str]:
        signals: list[str] = []
        for answer in self._tasks.ask(list(self._tasks.sockets), {"do": "stop", "graceful": graceful},
                                      COMMAND_PATIENCE).values():
            signals += [name for name in answer.get("signals", []) if name not in signals]
        return signals

    def replace(self, rank: int, plan: LaunchPlan) -> ChildProcess:
        """Task ``rank`` starts a new process in its dead rank's place (``plan``: the attempt's, every rank's), whose
        output channels connect to the hub again; its exit comes on the task's exit channel, as the first's did."""
        dead, channels = self.children[rank], StepChannels(len(self.children))
        streams = [channels.stream(rank, stream) for stream in STREAMS]
        self._hub.reopen(streams)
        dead.control.codes.pop(0, None)
        number = self._tasks.tell(rank, {"do": "replace", "plan": rank_plans(self.hellos, plan, self._gpus, None, ())[rank]})
        answers: list[dict] = []

        def answered(wait: bool) -> None:  # its answer (which comes once its channels are accepted, or says why not)
            answer = answers[0] if answers else self._tasks.answer(rank, number, time.monotonic() + COMMAND_PATIENCE, wait)
            answers[:] = [answer] if answer is not None else []
            if answer is not None and "error" in answer:
                raise LaunchError(f"taas: task {rank} on {dead.node} could not start a new rank {rank}: {answer['error']}")

        self._hub.accept(time.monotonic() + START_PATIENCE, streams, lambda: answered(False),
                         lambda missing: f"taas: the new rank {rank}'s output did not reach the kernel from {dead.node}")
        answered(True)
        hub = self._hub.connected
        self.children[rank] = SlurmChild(rank, dead.node, hub[streams[0]].fileno(), hub[streams[1]].fileno(),
                                         dead.control, dead.srun_ended, dead.srun_said)
        return self.children[rank]

    def stacks(self, ranks: Sequence[int]) -> dict[int, str]:
        found: dict[int, str] = {}
        for answer in self._tasks.ask(list(ranks), {"do": "stacks", "ranks": list(ranks)}, AUTOPSY_PATIENCE).values():
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
            self._tasks.ask(list(self._tasks.sockets), {"do": "end"}, END_PATIENCE)
            if self._srun is not None:
                self._srun.end(self.step)
        finally:
            self._hub.close()
