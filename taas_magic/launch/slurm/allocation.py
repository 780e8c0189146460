"""The allocation a session holds: one ``salloc`` the kernel made, or the job the kernel runs inside.

Runs in the kernel (:class:`Allocation`, on the cell's thread; ``salloc``'s lines read on a helper
thread, ``taas-salloc``) and in the allocation keeper (:func:`keep`,
``python -m taas_magic.launch.slurm.allocation``), which holds ``salloc``.

``%taas cluster slurm [OPTIONS]`` asks Slurm once ("reserve once, iterate", as Monarch does):
``salloc OPTIONS --no-kill cat``. ``salloc`` keeps the allocation while its command runs; its
command is ``cat`` reading a pipe, so the allocation lasts exactly as long as that pipe is
open. The pipe is held by a keeper (``python -m taas_magic.launch.slurm.allocation``), whose own
stdin is the kernel's lifeline: when the kernel releases the allocation, exits or is killed, the
keeper closes ``cat``'s pipe (``salloc`` then relinquishes a granted allocation) and sends
``salloc`` SIGTERM (which revokes one still queued). No process of ours runs on a node between
cells, and nothing depends on ``KillWait``. ``--no-kill``: a node that fails does not end the
allocation; the next attempt runs on the nodes left (launch/slurm/backend.py).

While queued, :meth:`Allocation.request` shows the job's state, reason, place in the queue
and the time waited, refreshed, and an interrupt cancels it (nothing is left in ``squeue``).

Where the kernel runs inside a job (``SLURM_JOB_ID``, as under batchspawner or Open OnDemand),
``%taas cluster slurm`` with no options uses that job; taas never cancels a job it did not make.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from taas_magic.errors import ClusterError
from taas_magic.launch.placement import Node
from taas_magic.launch.slurm import slurmcli

KEEPER = (sys.executable, "-m", "taas_magic.launch.slurm.allocation")
RELEASE_PATIENCE = 15.0  # seconds for salloc to give a released allocation back before scancel
QUEUE_REFRESH = 1.0  # seconds between two looks at a queued job
# What the probe step prints on each node: its name, and how many NVIDIA devices it has.
PROBE = ("import glob, os; import taas_magic; "
         "print(os.environ.get('SLURMD_NODENAME', '?'), len(glob.glob('/proc/driver/nvidia/gpus/*')))")
ENDED = ("COMPLETED", "COMPLETING", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE", "OUT_OF_MEMORY")  # a job in one of these holds nothing more
SHOWN_OPTIONS = ("partition", "account", "qos", "time", "constraint", "nodes", "gpus_per_node", "cpus_per_gpu")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%taas cluster slurm", add_help=False, allow_abbrev=False)
    parser.add_argument("-p", "--partition")
    parser.add_argument("-A", "--account")
    parser.add_argument("-q", "--qos")
    parser.add_argument("-t", "--time")
    parser.add_argument("-C", "--constraint")
    parser.add_argument("-N", "--nodes")
    parser.add_argument("--gpus-per-node", dest="gpus_per_node")
    parser.add_argument("--cpus-per-gpu", dest="cpus_per_gpu")
    return parser


@dataclass(frozen=True)
class AllocationRequest:
    """What ``%taas cluster slurm`` asks ``salloc`` for: the options people pass to salloc/sbatch
    by name, and any other salloc option passed through as written (``extra``)."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    constraint: str | None = None
    nodes: str | None = None
    gpus_per_node: str | None = None
    cpus_per_gpu: str | None = None
    extra: tuple[str, ...] = field(default=())

    @classmethod
    def parse(cls, text: str) -> "AllocationRequest":
        try:
            words = shlex.split(text)
        except ValueError as exc:
            raise ClusterError(f"taas: cannot read the Slurm options {text!r}: {exc}") from None
        passed: list[str] = []
        if "--" in words:  # everything after -- goes to salloc untouched
            index = words.index("--")
            words, passed = words[:index], words[index + 1:]
        known, unknown = _parser().parse_known_args(words)
        quiet = ("-Q", "--quiet")  # salloc would not say "Granted job allocation N", which is how taas learns it
        return cls(**vars(known), extra=tuple(word for word in unknown + passed if word not in quiet))

    @property
    def empty(self) -> bool:
        return all(getattr(self, name) is None for name in SHOWN_OPTIONS) and not self.extra

    def salloc_args(self) -> list[str]:
        args = [f"--{name.replace('_', '-')}={value}" for name in SHOWN_OPTIONS
                if (value := getattr(self, name)) is not None]
        if self.gpus_per_node is not None and not any(a.startswith(("--ntasks", "-n")) for a in self.extra):
            args.append(f"--ntasks-per-node={self.gpus_per_node}")  # a CPU for each GPU's rank
        return args + list(self.extra)


AllocationT = TypeVar("AllocationT", bound="Allocation")


class Allocation:
    """One Slurm job whose nodes the session's cells run on."""

    def __init__(self, job_id: str, made: bool, keeper: subprocess.Popen | None = None):
        self.job_id = job_id
        self.made = made  # taas made it (released with the session); False: the kernel's own job
        self._keeper = keeper
        self.released = False  # let go of (the kernel's own job is never ended, only not used)
        self.lost: set[str] = set()  # nodes a run found gone: no later step is placed on them
        self.info = self._read()
        self.node_address = slurmcli.node_address(self.info.nodes[0])  # where this host's route to the nodes goes
        self.has_cuda = self._probe()

    # -- getting one -----------------------------------------------------------------------
    @classmethod
    def current(cls: type[AllocationT]) -> AllocationT:
        """The job this kernel runs inside (``SLURM_JOB_ID``)."""
        job_id = os.environ.get("SLURM_JOB_ID", "").strip()
        if not job_id:
            raise ClusterError("taas: this kernel does not run inside a Slurm job (SLURM_JOB_ID is not set); "
                               "give %taas cluster slurm the options to ask for one, e.g. --gpus-per-node 4 --nodes 2")
        return cls(job_id, made=False)

    @classmethod
    def request(cls: type[AllocationT], request: AllocationRequest, show: Callable[[str], None]) -> AllocationT:
        """Ask Slurm for the allocation and wait while it is queued, showing the queue's state;
        an interrupt (or any error) cancels it and leaves nothing in the queue."""
        keeper: subprocess.Popen | None = None
        said: _SallocLines | None = None
        started = time.monotonic()
        try:
            keeper = subprocess.Popen(
                [*KEEPER, *request.salloc_args()], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, env=slurmcli.command_env(), start_new_session=True, close_fds=True,
            )
            said = _SallocLines(keeper)
            while not said.granted.wait(QUEUE_REFRESH if said.job_id else 0.05):
                if keeper.poll() is not None and not said.granted.is_set():
                    said.done.wait(2)
                    raise ClusterError(f"taas: salloc could not get the allocation: {said.last_error()}")
                if said.job_id:
                    show(_queue_line(said.job_id, time.monotonic() - started))
            assert said.job_id is not None  # "Granted job allocation N" names it
            _wait_running(said.job_id, show, started)
            return cls(said.job_id, made=True, keeper=keeper)
        except BaseException:
            if keeper is not None:
                _end_keeper(keeper)
            if said is not None and said.job_id:
                slurmcli.cancel(said.job_id)
            raise

    def _read(self) -> slurmcli.JobInfo:
        info = slurmcli.show_job(self.job_id)
        if info is None or info.state not in ("RUNNING", "CONFIGURING"):
            state = info.state if info is not None else "gone"
            raise ClusterError(f"taas: Slurm job {self.job_id} is not running ({state}); its nodes cannot run cells. "
                               "%taas cluster off, then %taas cluster slurm ... for a new allocation")
        return info

    def _probe(self) -> bool:
        """One step on every node: the kernel's Python runs there (the same path: a shared
        filesystem), and whether each node has the CUDA devices its GPUs name (a GPU GRES
        may be a label only, as on a test cluster)."""
        nodes = len(self.info.nodes)
        try:
            done = subprocess.run(["srun", f"--jobid={self.job_id}", f"--nodes={nodes}", f"--ntasks={nodes}",
                                   "--ntasks-per-node=1", "--overlap", "--gres=none", "--quiet", sys.executable, "-c", PROBE],
                                  env=slurmcli.command_env(), capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"taas: a probe step on the nodes of Slurm job {self.job_id} did not end within 300 s") from None
        found = dict(line.split() for line in done.stdout.splitlines() if len(line.split()) == 2)
        if len(found) < nodes:
            said = (done.stderr.strip().splitlines() or ["nothing"])[-1]
            raise ClusterError(f"taas: the kernel's Python ({sys.executable}) with taas_magic did not run on every node "
                               f"of Slurm job {self.job_id} (answered: {', '.join(found) or 'none'}; srun said: {said}); "
                               "the nodes need the same environment at the same path (a shared filesystem)")
        return self.info.gpus_total > 0 and all(int(found.get(node, 0)) >= self.info.gpus[node] for node in self.info.nodes)

    # -- what it has ----------------------------------------------------------------------------
    def refresh(self) -> slurmcli.JobInfo:
        """The job as the controller sees it now (its nodes, GPUs); raises ClusterError once it ended."""
        self.info = self._read()
        return self.info

    def usable_nodes(self) -> list[str]:
        """The allocation's nodes a step may use: not found lost by a run, not down or drained."""
        states = slurmcli.node_states(list(self.info.nodes))
        return [node for node in self.info.nodes if node not in self.lost and not _unusable(states.get(node, ""))]

    def nodes(self) -> list[Node]:
        """Its nodes as placement sees them (``%taas cluster``, ``--gpus auto``, a search's slots)."""
        usable = set(self.usable_nodes())
        return [Node(name, name, self.info.gpus.get(name, 0) if name in usable else 0,
                     self.info.gpus.get(name, 0) if name in usable else 0,
                     float(self.info.cpus.get(name, 0)), float(self.info.cpus.get(name, 0)))
                for name in self.info.nodes]

    def status_lines(self) -> list[str]:
        try:
            info = self.refresh()
        except ClusterError as exc:
            return [f"cluster: {exc}".replace("taas: ", "")]
        whose = "made by this session" if self.made else "this kernel's own job"
        lost = f", lost: {', '.join(sorted(self.lost))}" if self.lost else ""
        lines = [f"cluster: Slurm job {self.job_id} ({whose}), partition {info.partition}, {len(info.nodes)} node(s), "
                 f"{info.gpus_total} GPU, time left {slurmcli.time_left(self.job_id)}{lost}"]
        states = slurmcli.node_states(list(info.nodes))
        for node in info.nodes:
            lines.append(f"  {node}: {info.gpus[node]} GPU, {info.cpus[node]} CPU, {states.get(node, '?')}")
        return lines

    # -- giving it back ---------------------------------------------------------------------------
    def release(self) -> None:
        """Give back an allocation taas made (never the kernel's own job); idempotent."""
        self.released = True
        keeper, self._keeper = self._keeper, None
        if not self.made or keeper is None:
            return
        _end_keeper(keeper)
        deadline = time.monotonic() + RELEASE_PATIENCE
        while time.monotonic() < deadline:
            info = slurmcli.show_job(self.job_id)
            if info is None or info.state in ENDED:
                return
            time.sleep(0.1)
        slurmcli.cancel(self.job_id)  # salloc did not let go: the controller is told directly


def _unusable(state: str) -> bool:
    """A node state in which a step cannot run there: down, failing, not responding (``*``). A
    draining node still runs the steps of the jobs it holds."""
    return any(word in state for word in ("down", "fail", "not_responding")) or state.endswith("*")


def _queue_line(job_id: str, waited: float, info: slurmcli.JobInfo | None = None) -> str:
    info = info or slurmcli.show_job(job_id)
    if info is None:
        return f"taas: Slurm job {job_id}: not in the queue ({waited:.0f} s)"
    place = slurmcli.queue_position(job_id, info.partition) if info.state == "PENDING" else None
    where = f", {place[0]} of {place[1]} waiting in {info.partition}" if place else ""
    minutes, seconds = divmod(int(waited), 60)
    return (f"taas: Slurm job {job_id} {info.state} ({info.reason}){where}, waited {minutes}:{seconds:02d}; "
            "interrupt the kernel to cancel it")


class _SallocLines:
    """salloc's stderr, read as it comes: the job id, whether it was granted, what it said last."""

    def __init__(self, keeper: subprocess.Popen):
        self.job_id: str | None = None
        self.granted = threading.Event()
        self.done = threading.Event()
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(keeper,), name="taas-salloc", daemon=True).start()

    def _read(self, keeper: subprocess.Popen) -> None:
        assert keeper.stderr is not None
        try:
            for raw in keeper.stderr:
                line = raw.decode(errors="replace").strip()
                self.lines.append(line)
                words = line.split()
                if "job allocation" in line and words[-1].isdigit():
                    self.job_id = words[-1]
                    if "Granted" in line:
                        self.granted.set()
        finally:
            keeper.stderr.close()  # here, at its end: closing it from another thread would wait for this read
            self.done.set()

    def last_error(self) -> str:
        errors = [line.removeprefix("salloc: ") for line in self.lines if "error" in line.lower()]
        return (errors or self.lines or ["salloc exited without a word"])[-1]


def _wait_running(job_id: str, show: Callable[[str], None], started: float) -> None:
    """salloc says "Granted" before the nodes are ready (nodes booting, or powered up from saving):
    wait, shown and interruptible, for the job to run before anything is started on them."""
    while True:
        info = slurmcli.show_job(job_id)
        if info is None or info.state != "CONFIGURING":
            return
        show(_queue_line(job_id, time.monotonic() - started, info))  # the look just taken, not a second one
        time.sleep(QUEUE_REFRESH)


def _end_keeper(keeper: subprocess.Popen) -> None:
    assert keeper.stdin is not None
    try:
        keeper.stdin.close()  # the keeper's lifeline: it ends salloc
    except OSError:
        pass
    try:
        keeper.wait(RELEASE_PATIENCE + 5)  # the keeper's own patience with salloc, and then some
    except subprocess.TimeoutExpired:
        os.killpg(keeper.pid, signal.SIGKILL)  # the keeper leads its session: its salloc goes with it, never orphaned
        keeper.wait()



def _term_with_keeper() -> None:
    """In salloc, before exec: SIGTERM when the keeper dies however it dies (the keeper is one
    thread here, so the signal follows the process), which revokes a queued request; a granted
    one ends as ``cat`` meets the end of the keeper's pipe."""
    from taas_magic.rank.lifeline import PR_SET_PDEATHSIG, prctl

    prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


def _until_end_of_stdin() -> None:
    """Block until the kernel's end of the pipe closes. fd 0 itself, not sys.stdin: a daemon thread
    blocked in sys.stdin's reader holds its lock, and the interpreter's exit would fail on it."""
    try:
        while os.read(0, 1 << 16):
            pass
    except OSError:
        pass


def keep(salloc_args: list[str]) -> int:
    """The keeper: ``salloc ARGS --no-kill cat`` with ``cat`` on a pipe this process holds, until
    this process's stdin (the kernel's lifeline) ends; then the allocation is given back."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's interrupt is not for the allocation
    salloc = subprocess.Popen(["salloc", *salloc_args, "--no-kill", "cat"], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, close_fds=True, preexec_fn=_term_with_keeper)
    waiter = threading.Thread(target=_until_end_of_stdin, daemon=True)
    waiter.start()
    while waiter.is_alive() and salloc.poll() is None:
        waiter.join(0.2)
    assert salloc.stdin is not None
    queued = not _has_children(salloc.pid)  # granted, salloc runs cat; queued, it has no child yet
    salloc.stdin.close()  # cat ends: a granted allocation is relinquished (a SIGTERM now could leave salloc stuck)
    if queued and salloc.poll() is None:
        salloc.send_signal(signal.SIGTERM)  # a queued one is revoked
    try:
        return salloc.wait(RELEASE_PATIENCE)
    except subprocess.TimeoutExpired:
        salloc.kill()  # the kernel then cancels the job itself (Allocation.release)
        return salloc.wait()


def _has_children(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listed:
            return bool(listed.read().split())
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(keep(sys.argv[1:]))
