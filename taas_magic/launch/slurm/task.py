"""One task of a cell's ``srun`` step: ``python -m taas_magic.launch.slurm.task``.

Runs in each Slurm task (``python -m taas_magic.launch.slurm.task``, started by the kernel's
``srun``): the commands on its main thread, its stdin lifeline on a thread of its own.

Slurm starts one per rank, wherever it placed them. Each task:

1. reads the kernel's output hub (host, port, the run's key) on its stdin, which ``srun
   --input=all`` gives every task, and which then stays its lifeline: when the kernel's
   ``srun`` ends, stdin ends, and the task stops its rank and leaves;
2. connects its command channel (the run's key proven) and says where Slurm put it:
   ``SLURM_PROCID`` (its RANK), ``SLURM_LOCALID``, ``SLURM_NODEID``, the node, the GPU Slurm
   bound to it, the address the kernel reached it from, and, task 0, a port reserved for the
   rendezvous on its node;
3. receives its rank's plan (environment, working folder, handshake, place, autopsy file),
   made by the kernel from every task's answer (launch/slurm/step.py), and starts the rank
   with the local machinery (launch/hosts/agent.py's HostAgent: a fresh ``python -m taas_magic.rank``
   in its own session, its output pumped to the hub, its exit code sent after its output);
4. serves the kernel's commands until told to end: ``stop`` (the INT -> TERM -> KILL
   ladder), ``stacks`` (the hang autopsy, read on this node), ``end``.

Nothing of the task outlives the step: it exits when its rank is reaped, and Slurm's step
ends with it.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import sys
import threading
from typing import TYPE_CHECKING

from taas_magic import wire
from taas_magic.peers import StepChannels

if TYPE_CHECKING:
    from taas_magic.launch.contract import LaunchPlan

COMMAND = (sys.executable, "-m", "taas_magic.launch.slurm.task")


def encode(record: bytes) -> str:
    """A prepared element's record on the command channel (launch/slurm/courier.py)."""
    return base64.b64encode(record).decode("ascii")


def decode(text: str) -> bytes:
    return base64.b64decode(text)


def where_slurm_put_me(address: str, master_port: int | None) -> dict:
    """This task's hello: Slurm's own variables, and what the kernel needs to plan its rank."""
    env = os.environ
    return {
        "task": int(env["SLURM_PROCID"]),
        "local": int(env.get("SLURM_LOCALID", "0")),
        "node_index": int(env.get("SLURM_NODEID", "0")),
        "node": env.get("SLURMD_NODENAME") or socket.gethostname(),
        "tasks": int(env.get("SLURM_NTASKS") or env.get("SLURM_STEP_NUM_TASKS") or "1"),
        "step": f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}",
        "gpus": env.get("CUDA_VISIBLE_DEVICES"),
        "address": address,
        "master_port": master_port,
        "pid": os.getpid(),
    }


def rank_env(planned: dict[str, str], visible: str | None, threads: str | None) -> dict[str, str]:
    """The rank's environment: the kernel's plan, with this task's Slurm variables (not the
    kernel's) and the node's GPUs in local-task order, so LOCAL_RANK indexes this task's own;
    ``OMP_NUM_THREADS`` the person's (``threads``), else the CPUs Slurm gave this task."""
    env = {name: value for name, value in planned.items() if not name.startswith("SLURM")}
    env.update({name: value for name, value in os.environ.items() if name.startswith("SLURM")})
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env["OMP_NUM_THREADS"] = threads or str(max(1, min(cpus, int(os.environ.get("SLURM_CPUS_PER_TASK") or cpus))))
    return env


class Task:
    """The task's side of the command channel, and its rank under a HostAgent."""

    def __init__(self, hub: wire.Handshake):
        from taas_magic.launch.hosts.agent import HostAgent, connect_channel

        self.hub = hub
        self.task = int(os.environ["SLURM_PROCID"])
        self.channels = StepChannels(int(os.environ.get("SLURM_NTASKS") or os.environ.get("SLURM_STEP_NUM_TASKS") or "1"))
        self.sock = connect_channel(hub, self.channels.command(self.task))
        self.reader = self.sock.makefile("rb")
        self.agent = HostAgent()
        self.closing = threading.Lock()  # the end command and the lifeline both close the agent: once
        self.closed = False

    def send(self, message: dict) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def hello(self) -> None:
        address = self.sock.getsockname()[0]
        # task 0 reserves the rendezvous port; the agent holds it until its rank ends, since rank 0's store binds
        # it (SO_REUSEADDR) only when the cell calls init_process_group: released earlier, another process may take it
        port = self.agent.reserve_master_port() if self.task == 0 else None
        self.send(where_slurm_put_me(address, port))

    def start(self) -> None:
        line = self.reader.readline()
        if not line:
            raise ConnectionError("the kernel closed the command channel before sending the plan")
        plan = json.loads(line)
        self.agent.start(_launch_plan(plan), self.task, self.hub, self.channels.exits(self.task),
                         command=tuple(plan["command"]) if plan.get("command") else None, dirs=tuple(plan.get("dirs", ())))

    def replace(self, plan: dict) -> dict:
        """A new process in this task's dead rank's place (a kept rank: kernel/supervision/replacement.py)."""
        try:
            self.agent.replace(0, _launch_plan(plan), self.hub)
        except Exception as error:  # noqa: BLE001 - said to the kernel, which says it in the cell
            return {"error": f"{type(error).__name__}: {error}"}
        return {"replaced": True}

    def serve(self) -> None:
        """The kernel's commands, one JSON line each, each answered with its number, until ``end``
        (or the channel ends)."""
        for line in self.reader:
            command = json.loads(line)
            what, number = command["do"], command.get("number")
            if what == "interrupt":
                self.agent.interrupt(command["ranks"])
                self.send({"number": number, "interrupted": True})
            elif what == "stop":
                self.send({"number": number, "signals": self.agent.stop(command.get("graceful", True))})
            elif what == "stacks":
                stacks = self.agent.stacks(command["ranks"])
                self.send({"number": number, "stacks": {str(k): v for k, v in stacks.items()}})
            elif what == "publish":  # records a data worker of this task prepared, for another node's ranks
                records = [encode(self.agent.publish(path, offset)) for path, offset in command["places"]]
                self.send({"number": number, "records": records})
            elif what == "mirror":  # records from another node, into this node's cache for its ranks
                places = self.agent.mirror(command["ram"], *(decode(text) for text in command["records"]))
                self.send({"number": number, "places": [list(place) for place in places]})
            elif what == "replace":
                self.send({"number": number, **self.replace(command["plan"])})
            elif what == "end":
                self.close()
                self.send({"number": number, "ended": True})
                return
        self.close()

    def close(self) -> None:
        with self.closing:
            if not self.closed:
                self.closed = True
                self.agent.close()


def _launch_plan(plan: dict) -> LaunchPlan:
    """The task's one rank (or data worker) as the kernel's plan line gives it."""
    from taas_magic.launch.contract import LaunchPlan

    env = rank_env(plan["env"], plan.get("visible"), plan.get("threads"))
    return LaunchPlan(1, [env], plan["cwd"], plan["handshake"], [wire.Placement.parse(plan["place"])],
                      [plan["stack_file"]] if plan.get("stack_file") else [])


def _watch_stdin(task: Task) -> None:
    """srun's stdin is the lifeline: once it ends (the kernel's srun is gone), the rank is stopped
    (after an end already under way, if one is) and the task leaves."""
    try:
        while os.read(0, 1 << 16):  # fd 0 itself: a daemon thread blocked in sys.stdin would hold its lock,
            pass  # and the interpreter's exit would wait a second for it
    except OSError:
        pass
    task.close()
    os._exit(0)


def main() -> int:
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the kernel's srun went away before it said anything
    task = Task(wire.Handshake.parse(line))
    threading.Thread(target=_watch_stdin, args=(task,), name="taas-lifeline", daemon=True).start()
    try:
        task.hello()
        try:
            task.start()
        except Exception as exc:  # noqa: BLE001 - whatever stopped the rank's start, the kernel says it in one line
            task.send({"error": f"{type(exc).__name__}: {exc}"})
            task.close()
            return 1
        task.serve()
    except (ConnectionError, OSError) as exc:
        print(f"taas: slurm task {task.task}: {exc}", file=sys.stderr)
        task.close()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
