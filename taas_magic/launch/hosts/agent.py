"""One agent per host (a Ray actor, or a Slurm task's): starts that host's ranks with the local machinery.

Runs in a Ray host agent (the actor process Ray starts on each host, on the actor's one thread) and
in a Slurm task (launch/slurm/task.py holds one); the pumps on threads of their own.

The agent runs :class:`~taas_magic.launch.local.processes.LocalProcessGroup` on its host, so ranks there
are started, isolated (the write rule) and stopped exactly as in the local mode: fresh
``python -m taas_magic.rank`` processes in their own sessions, a stdin lifeline, the
INT -> TERM -> KILL ladder. A host that does not see the notebook's repository (the run's marker
is not there: writes/away.py) gives every rank a layer, rank 0's too, and the ranks send what is
the repository's to the kernel as they end. What the agent adds is the way back to the kernel:

- each rank's stdout and stderr are pumped, bytes unchanged, into one TCP connection each
  to the kernel's output hub (``launch/hosts/outputhub.py``), so the supervisor reads them as it reads
  local pipes, and an end of file means the rank's output is complete;
- one control connection carries ``LOCAL_INDEX EXIT_CODE`` lines, each sent only after
  that rank's output reached end of file, so no exit overtakes its output.

Every connection proves the run's key (``wire.hello_mac`` over the hub's nonce) before the
kernel reads a byte of it. The ranks themselves connect to the kernel's rank server with
the handshake, as local ranks do. If the agent dies (its host, or the kernel's Ray driver,
went away), each rank's lifeline breaks and the rank exits.

IMPORTANT: the ranks are started from the actor's main thread (a plain, single-threaded
actor): ``PR_SET_PDEATHSIG`` fires when the *thread* that started a process exits, so a
rank started from a pool thread could be killed by the pool, or outlive the agent.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import threading
import time

from taas_magic import wire
from taas_magic.errors import LaunchError
from taas_magic.feed.segments import CacheDirs, SegmentWriter
from taas_magic.launch.contract import ChildProcess, LaunchPlan
from taas_magic.launch.local.processes import LocalProcessGroup
from taas_magic.launch.rankenv import visible_gpu_count
from taas_magic.peers import STREAMS, HubChannels
from taas_magic.procs import OWNER_VARIABLE, kill_tagged
from taas_magic.tempdirs import remove_tree
from taas_magic.writes.away import AwayHost, settle


def connect_channel(hub: wire.Handshake, channel: int, timeout: float = 30) -> socket.socket:
    """One channel to the kernel's output ``hub``, the run's key proven for it."""
    try:
        sock, _ = wire.connect((hub.host, hub.port), hub.key, channel, timeout)
    except ConnectionError as exc:
        raise ConnectionError(f"taas: the kernel's output hub closed the connection during the handshake ({exc})") from None
    return sock


class KernelLink:
    """One attempt's way back to the kernel from this host: each rank's stdout and stderr pumped into a channel of
    the hub, and each rank's exit said on the control channel once its output reached end of file, until the ranks
    end (a kept rank that died may be replaced: its new process is watched as the first was)."""

    def __init__(self, hub: wire.Handshake, first_rank: int):
        self.hub, self.first_rank = hub, first_rank
        self.threads: list[threading.Thread] = []
        self.sockets: list[socket.socket] = []  # the control channel
        self._streams: dict[int, list[socket.socket]] = {}  # each rank's output channels
        self._watched: dict[int, tuple[ChildProcess, list[threading.Thread]]] = {}  # exits not said yet: rank, pumps
        self._reporter: threading.Thread | None = None
        self._ending = threading.Event()  # the ranks are ending: the reporter's last look

    def watch(self, local: ChildProcess) -> None:
        """This host's rank ``local.index``: its output pumped, its exit to be said."""
        pumps = []
        rank = self.first_rank + local.index
        for dead in self._streams.pop(local.index, []):  # a dead rank's, whose pumps ended
            dead.close()
        for stream, fd in zip(STREAMS, (local.stdout_fd, local.stderr_fd)):
            sock = connect_channel(self.hub, HubChannels.stream(rank, stream))
            self._streams.setdefault(local.index, []).append(sock)
            pump = threading.Thread(target=_pump, args=(fd, sock), name=f"taas-pump-{rank}", daemon=True)
            pump.start()
            pumps.append(pump)
        self.threads.extend(pumps)
        self._watched[local.index] = (local, pumps)

    def report(self, control: int) -> None:
        """The exits, said on channel ``control`` from now on."""
        sock = connect_channel(self.hub, control)
        self.sockets.append(sock)
        self._reporter = threading.Thread(target=self._report_exits, args=(sock,), name="taas-exits", daemon=True)
        self._reporter.start()
        self.threads.append(self._reporter)

    @property
    def open(self) -> bool:
        """The control channel still carries exits (a new process may be watched)."""
        return self._reporter is not None and self._reporter.is_alive()

    def _report_exits(self, control: socket.socket) -> None:
        try:
            while self._watched or not self._ending.is_set():
                for index, (local, pumps) in list(self._watched.items()):
                    code = local.poll()
                    if code is None or any(pump.is_alive() for pump in pumps):
                        continue
                    control.sendall(f"{index} {code}\n".encode())
                    if self._watched.get(index, (None,))[0] is local:  # (not replaced meanwhile)
                        del self._watched[index]
                time.sleep(0.02)
        except OSError:
            pass  # the kernel went away; close() (or the agent's death) stops the ranks
        finally:
            try:
                control.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        """Once the ranks were stopped: the last exits said, every thread joined, every channel closed."""
        self._ending.set()
        for thread in self.threads:
            thread.join(timeout=5)
        for sock in [*self.sockets, *(sock for streams in self._streams.values() for sock in streams)]:
            sock.close()


class HostAgent:
    """The ranks of one run on one host."""

    def __init__(self) -> None:
        self.group = LocalProcessGroup([])  # this attempt's processes: none before start and after end_ranks
        self._port: wire.PortReservation | None = None
        self._link: KernelLink | None = None  # this attempt's output and exits to the kernel
        self._made_dirs: list[str] = []
        self._away: list[str] = []  # this attempt's folders for a repository this host does not see (writes/away.py)
        self._mirror: tuple[CacheDirs, SegmentWriter] | None = None  # records copied to this host
        self._owners: set[str] = set()  # the TAAS_OWNER tags of what this agent started
        self._ranks = range(0)  # the (global) ranks of this attempt on this host
        self._local: tuple[str, AwayHost | None] = ("", None)  # the attempt's cwd here, and its away layers (or None)

    def describe(self) -> dict:
        import ray

        return {
            "address": ray.util.get_node_ip_address(),
            "gpu_ids": [str(gpu) for gpu in ray.get_gpu_ids()],
            "cuda_devices": visible_gpu_count(),  # real devices, not Ray's declared resource
        }

    def reserve_master_port(self) -> int:
        """A free port for MASTER_PORT on this host (every address), held until :meth:`close`."""
        self._port = wire.PortReservation()
        return self._port.port

    def start(self, plan: LaunchPlan, first_rank: int, hub: wire.Handshake, control: int,
              command: tuple[str, ...] | None = None, dirs: tuple[str, ...] = ()) -> None:
        """Start this host's ranks (global ranks ``first_rank`` ...) and their pumps.

        ``hub`` is where the kernel's output hub listens and the run's key; this host's
        exit codes go on its channel ``control``. ``command`` starts data workers instead of
        ranks; ``dirs`` are directories the kernel made on its host for them (the data cache),
        made here too if this is another host, and removed at :meth:`close`.
        """
        cwd = plan.cwd if os.path.isdir(plan.cwd) else tempfile.gettempdir()
        away = settle(list(plan.places), plan.cwd)  # None: this host sees the notebook's repository
        if away is not None:  # its ranks write in layers here, and send what is the repository's (writes/away.py)
            self._away.append(away.root)
            cwd = away.cwd
        self._local = (cwd, away)
        plan = self._here(plan)
        layers = [place.layer for place in plan.places if place.layer]
        stacks = {os.path.dirname(path) for path in plan.stack_files}
        self._owners = {env[OWNER_VARIABLE] for env in plan.envs if env.get(OWNER_VARIABLE)}
        for path in [*layers, *stacks, *dirs]:
            made = _make_owner_only(path)  # another host: its scratch layer or cache lives here
            if made is not None:
                self._made_dirs.append(made)
        if command:
            self.group = LocalProcessGroup.start(plan, command, "data worker")
        else:
            self.group = LocalProcessGroup.start(plan)
        self._ranks = range(first_rank, first_rank + len(self.group.children))
        self._link = KernelLink(hub, first_rank)
        for local in self.group.children:
            self._link.watch(local)
        self._link.report(control)

    def replace(self, local: int, plan: LaunchPlan, hub: wire.Handshake) -> None:
        """A new process in this host's dead rank ``local``'s place, as ``plan`` (this host's part of the attempt's)
        starts it; its output pumped to the hub again and its exit reported as the others' (a kept rank that died:
        kernel/supervision/replacement.py)."""
        if self._link is None or not self._link.open:
            raise LaunchError("taas: this host's control channel to the kernel is closed")
        self._link.hub = hub
        self._link.watch(self.group.replace(local, self._here(plan)))

    def _here(self, plan: LaunchPlan) -> LaunchPlan:
        """``plan`` as this host runs it: its working folder, and its places in layers where it does not see the
        repository."""
        cwd, away = self._local
        if away is not None:
            plan = dataclasses.replace(plan, places=[away.place(place) for place in plan.places])
        return dataclasses.replace(plan, cwd=cwd)

    # -- prepared elements through Ray's object store -----------------------------------
    def publish(self, path: str, offset: int) -> bytes:
        """A record a data worker on this host prepared; Ray keeps the returned bytes in
        this node's object store and moves them to the node that asks for them."""
        from taas_magic.transfer.records import read_raw

        return read_raw(path, offset)

    def mirror(self, ram_budget: int, *records: bytes) -> list[tuple[str, int]]:
        """Store records (Ray resolved them from the workers' hosts) in this host's cache,
        RAM first then disk, as the local mode does; return where this host's ranks read them."""
        if self._mirror is None:
            dirs = CacheDirs.create(f"mirror-{os.getpid()}")
            self._mirror = (dirs, SegmentWriter(dirs, 0, ram_budget))
        return [self._mirror[1].append_raw(record) for record in records]

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to those of these (global) ranks that run on this host."""
        self.group.interrupt([rank - self._ranks.start for rank in ranks if rank in self._ranks])

    def stop(self, graceful: bool = True) -> list[str]:
        return self.group.stop(graceful)

    def stacks(self, ranks: list[int]) -> dict[int, str]:
        """The autopsy of those of these (global) ranks that run on this host (stacks.py), read here and sent back."""
        local = [rank - self._ranks.start for rank in ranks if rank in self._ranks]
        return {rank + self._ranks.start: dump for rank, dump in self.group.stacks(local).items()}

    def end_ranks(self) -> None:
        """This attempt's processes are stopped and reaped, with what they left (a restart follows, or
        :meth:`close`); the master port, the element copies and the made folders stay."""
        self.group.stop()  # the pumps see end of file before their pipes are closed
        link, self._link = self._link, None
        if link is not None:
            link.close()  # the last exits said
        self.group.close()
        self.group, self._ranks = LocalProcessGroup([]), range(0)
        for owner in self._owners:
            kill_tagged(owner)  # what they started and left, on this host
        for path in self._away:  # what they wrote for the repository was sent as each ended; Ray kills agents unclosed
            remove_tree(path)
        self._away = []

    def close(self) -> None:
        self.end_ranks()
        if self._port is not None:
            self._port.close()
        if self._mirror is not None:
            self._mirror[1].close()
            self._mirror[0].remove()
        for path in self._made_dirs:
            remove_tree(path)


def _make_owner_only(path: str) -> str | None:
    """Make ``path`` and its missing parents, each owner-only; return the topmost one this call
    made (to remove it, and all below, at the end), or None where it was there already. Another
    process of the same run on this host (a Slurm task beside this one) may make them at the same
    moment: what it made first is its own to remove."""
    missing = []
    current = os.path.abspath(path)
    while not os.path.isdir(current):
        missing.append(current)
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    made = None
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue
        made = made or folder
    return made


def _pump(fd: int, sock: socket.socket) -> None:
    """Copy a rank's pipe into its channel until end of file, then half-close the channel."""
    try:
        while True:
            try:
                data = os.read(fd, 1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            sock.sendall(data)
    except OSError:
        pass  # the kernel closed the channel; the rank is being stopped
    finally:
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
