"""A real multi-node Slurm on this one machine: munge, one ``slurmctld``, several ``slurmd -N``.

Debian's ``slurm-wlm`` (22.05 here) and ``munge``, as ``.ci/run`` installs them with apt. Every
node is this host (``NodeHostname=localhost``, each ``slurmd`` on its own port); each declares
``gpu:2`` GRES backed by character devices made with ``mknod`` (a GPU-typed GRES needs
``File=``), so ``srun --gres=gpu:K`` hands each task its ``CUDA_VISIBLE_DEVICES`` as a real
cluster does, though there is no CUDA behind it (the ranks use gloo). munge listens on a socket
of its own (``AuthInfo=socket=``) and every file lives in one owner-only temporary folder, so
nothing of the machine's own is touched; the daemons need root (``slurmd`` starts each job's
``slurmstepd``, which takes on the job's user), which CI has.

Each node has a folder of its own disk, :meth:`MiniSlurm.node_local`: every ``slurmd`` runs in a
mount namespace of its own (``unshare --mount``) where ``<dir>/node-local/<node>`` is an empty
tmpfs, so what its jobs see there is theirs alone, while the kernel and the other nodes see this
machine's folder. A repository in node1's folder is one node1 does not see (tests/slurm/test_slurm_away.py).

Used by tests/slurm (one cluster per module) and bench/slurm.py::

    with MiniSlurm(nodes=3) as slurm:
        subprocess.run(["srun", "-N2", "hostname"], env=slurm.env())
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from taas_magic.writes.layer import inside

GPUS_PER_NODE = 2
CPUS_PER_NODE = 4  # declared (SlurmdParameters=config_overrides): room for ranks and data workers on 2 cores


def missing() -> str | None:
    """Why a MiniSlurm cannot start here, or None."""
    for tool in ("slurmctld", "slurmd", "munged", "srun", "salloc"):
        if shutil.which(tool) is None:
            return f"Slurm is not installed ({tool} not found; apt install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "a MiniSlurm's slurmd must run as root (it starts each job's slurmstepd)"
    return None


def _die_with_parent() -> None:
    """In the daemon, before exec: SIGTERM when the process that started it dies (a test run
    killed mid-way leaves no Slurm running)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def _can_unshare() -> bool:
    """Whether a process may have a mount namespace of its own here (root, and a kernel that allows it)."""
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True).returncode == 0


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class MiniSlurm:
    """One controller, ``nodes`` nodes named node1..nodeN with 2 fake GPUs and 4 CPUs each, and
    ``cpu_nodes`` CPU-only nodes cpu1..cpuM with 4 CPUs each."""

    def __init__(self, nodes: int = 3, cpu_nodes: int = 0, slurmd_timeout: int = 10):
        self.gpu_names = [f"node{k}" for k in range(1, nodes + 1)]
        self.names = self.gpu_names + [f"cpu{k}" for k in range(1, cpu_nodes + 1)]
        self.dir = Path(tempfile.mkdtemp(prefix="taas-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self.slurmd_timeout = slurmd_timeout
        self.daemons: dict[str, subprocess.Popen] = {}
        self.own_folders = _can_unshare()  # each node's own folder (node_local)

    # -- the environment every Slurm command and every kernel of the tests runs with -----------
    def env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, "SLURM_CONF": str(self.conf), **extra}
        for name in [name for name in env if name.startswith("SLURM_") and name != "SLURM_CONF"]:
            if name not in extra:
                del env[name]  # this process is not inside a job
        return env

    def run(self, *command: str, check: bool = True, timeout: float = 30) -> str:
        done = subprocess.run(command, env=self.env(), capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    # -- start and stop ------------------------------------------------------------------------
    def start(self) -> "MiniSlurm":
        try:
            self._write_files()
            self._start_munge()
            self._start("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
            for name in self.names:
                self._start(name, self._slurmd(name))
            self.wait_idle(self.names)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_files(self) -> None:
        self.dir.chmod(0o700)
        for sub in ("state", "spool", "log", "dev"):
            (self.dir / sub).mkdir()
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for index in range(GPUS_PER_NODE):
            os.mknod(self.dir / "dev" / f"gpu{index}", 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        ctld_port, *node_ports = _free_ports(1 + len(self.names))
        nodes = "\n".join(
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={CPUS_PER_NODE} RealMemory=2000 "
            + (f"Gres=gpu:{GPUS_PER_NODE} " if name in self.gpu_names else "") + "State=UNKNOWN"
            for name, port in zip(self.names, node_ports)
        )
        node_list = ",".join(self.names)
        d = self.dir
        self.conf.write_text(f"""\
ClusterName=taasmini
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
GresTypes=gpu
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout}
SlurmctldTimeout=10
InactiveLimit=0
KillWait=30
MinJobAge=5
MessageTimeout=5
{nodes}
PartitionName=gpu Nodes={node_list} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")
        (self.dir / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={','.join(self.gpu_names)} Name=gpu File={d}/dev/gpu[0-{GPUS_PER_NODE - 1}]\n"
        )

    def _start_munge(self) -> None:
        d = self.dir
        self._start("munged", ["munged", "-F", "--force", f"--socket={d}/munge.socket", f"--key-file={d}/munge.key",
                               f"--pid-file={d}/munged.pid", f"--log-file={d}/log/munged.log", f"--seed-file={d}/munged.seed"])
        deadline = time.monotonic() + 10
        while not (d / "munge.socket").exists():
            if time.monotonic() > deadline or self.daemons["munged"].poll() is not None:
                raise RuntimeError(f"munged did not start: {self._log('munged')}")
            time.sleep(0.05)

    def _start(self, name: str, command: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "wb")
        self.daemons[name] = subprocess.Popen(command, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_die_with_parent)
        log.close()

    def _log(self, name: str) -> str:
        texts = []
        for path in (self.dir / "log").glob(f"*{name}*"):
            texts.append(path.read_text(errors="replace")[-3000:])
        return "\n".join(texts)

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        states = {}
        for line in out.splitlines():
            name, state = line.split()
            states[name] = state
        return states

    def wait_idle(self, names: list[str], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for name, proc in self.daemons.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}): {self._log(name)}")
            states = self.node_states()
            if all(states.get(name) == "idle" for name in names):
                return
            time.sleep(0.2)
        raise RuntimeError(f"the nodes did not become idle within {timeout:g} s: {states}\n{self._log('slurm')}")

    def jobs(self) -> list[str]:
        """Every job the controller knows (any state), as ``JOBID STATE``."""
        return self.run("squeue", "-h", "-o", "%i %T", check=False).split("\n")[:-1]

    def node_processes(self, name: str) -> list[psutil.Process]:
        """What runs on node ``name`` of this cluster: its slurmd, its slurmstepds, and their tasks.

        Only this cluster's: pytest-xdist's other worker may run a MiniSlurm of its own beside this one,
        with nodes of the same names (a loose match here once killed that cluster's node2 tasks
        mid-test, and its test failed with a rank "killed by SIGKILL")."""
        found = []
        slurmd = self.daemons.get(name)
        spool = str(self.dir / "spool" / name)
        for proc in psutil.process_iter(["pid", "name", "cmdline"]):
            try:
                if slurmd is not None and proc.pid == slurmd.pid:
                    found.append(proc)
                elif proc.info["name"] == "slurmstepd" and any(inside(f.path or "", spool) for f in proc.open_files()):
                    found.append(proc)
                elif (environ := proc.environ()).get("SLURMD_NODENAME") == name and environ.get("SLURM_CONF") == str(self.conf):
                    found.append(proc)
            except psutil.Error:
                continue
        return found

    def lose_node(self, name: str) -> None:
        """Node ``name`` dies: its slurmd, its slurmstepds and every task on it are killed at once."""
        for proc in self.node_processes(name):
            try:
                proc.kill()
            except psutil.Error:
                pass
        slurmd = self.daemons.pop(name, None)
        if slurmd is not None:
            slurmd.wait(10)

    def node_local(self, name: str) -> Path | None:
        """A folder that node ``name`` has of its own (the kernel and the other nodes see this machine's
        folder there); None where mount namespaces are not allowed here."""
        return self.dir / "node-local" / name if self.own_folders else None

    def _slurmd(self, name: str) -> list[str]:
        command = ["slurmd", "-D", "-N", name, "-f", str(self.conf)]
        folder = self.node_local(name)
        if folder is None:
            return command
        folder.mkdir(parents=True, exist_ok=True)
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount -t tmpfs -o mode=0755 taas-node-local "$0" && exec "$@"', str(folder), *command]

    def restore_node(self, name: str) -> None:
        self._start(name, self._slurmd(name))
        self.run("scontrol", "update", f"NodeName={name}", "State=RESUME", check=False)
        self.wait_idle([name], timeout=60)

    def stop(self) -> None:
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
        for name in [n for n in self.daemons if n != "munged"] + ["munged"]:
            proc = self.daemons.get(name)
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for proc in psutil.process_iter(["name"]):  # a slurmstepd left by a killed node; a client (salloc, srun) a
            try:  # failed test left, which would retry the vanished controller for ever, spinning a core
                if proc.info["name"] == "slurmstepd" and any(str(self.dir) in (f.path or "") for f in proc.open_files()):
                    proc.kill()
                elif proc.info["name"] in ("salloc", "srun") and proc.environ().get("SLURM_CONF") == str(self.conf):
                    proc.kill()
            except psutil.Error:
                pass
        self.daemons.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "MiniSlurm":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":  # a Slurm to try things on: python -m tests.slurm.minislurm
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped as by Ctrl-C: the daemons go too
    with MiniSlurm() as slurm:
        print(f"export SLURM_CONF={slurm.conf}\n(Ctrl-C stops it)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
