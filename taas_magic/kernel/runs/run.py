"""One cell's run as one object: everything it holds, released in reverse order, whatever happens.

Runs in the kernel, on the run's thread once started (kernel/runs/background.py). The plan step
(kernel/runs/runplan.py) takes the first parts, each one's release registered on an
``contextlib.ExitStack`` there and then (as trio's nursery does, so nothing is released by a list of
calls that a new part could be left out of), and hands them to :class:`Run` as :class:`Held`; the run
takes the rest in its constructor and is whole from then on. In the order they are taken:

1. the data run (its cache folders), when the cell reads registered loaders;
2. the backend (a reserved port; a cluster's placement and agents), a context manager;
3. the run spec, with its checkpoint folder (the session's record of the last run names it) and its
   stacks folder (the ranks' autopsy files);
4. the ranks' scratch layers (what the write rule diverted is reported, then removed), after the
   collective checkpoints the ranks named are checked (writes/completeness.py: an incomplete one is named),
   after the files sent from hosts that do not see the repository are in it (writes/landing.py); on a
   cluster, the run's marker in the repository, by which a host knows whether it sees it (writes/away.py);
5. the rank server, and the closure handoff (its memory files, its CUDA IPC handles; it
   answers the ranks that ask for those tensors in host memory until it is released);
6. last, so released first: the moment the ranks are gone, whatever they started is
   killed by its owner tag and the backend is released (the spares start warming before
   the rest is cleaned up).

Leaving the run (``with run:``) records how it ended for ``%taas status`` and releases all
of it; a run that failed also removes any results file rank 0 had written. The last entry
of its log (output/runlog.py) says how it ended, written after everything was released. A release that
raises does not stop the others (``ExitStack``); the first error is the one raised.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback as traceback_module
from contextlib import ExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Callable, Mapping

from taas_magic import protocol, wire
from taas_magic.autopsy.dump import stack_file
from taas_magic.cell.pragma import RunSettings
from taas_magic.compilecache.folder import point_ranks
from taas_magic.kernel.runs.profiled import Profiles
from taas_magic.kernel.runs.rankset import RankSet
from taas_magic.kernel.runs.summary import LastRun
from taas_magic.kernel.supervision.dataplane import DataRun
from taas_magic.kernel.supervision.prompts import PromptDesk
from taas_magic.launch.contract import Backend, LaunchPlan
from taas_magic.launch.rankenv import rank_environments
from taas_magic.output.runlog import RunLog
from taas_magic.peers import PeerIds
from taas_magic.procs import OWNER_VARIABLE
from taas_magic.runspec import RunSpec
from taas_magic.search.link import TrialLink
from taas_magic.transfer import memfile
from taas_magic.transfer.handoff import ClosureHandoff
from taas_magic.transfer.pack import Packing
from taas_magic.transfer.results import apply_results
from taas_magic.transfer.returns import Result
from taas_magic.writes.away import Marker
from taas_magic.writes.completeness import Ledger
from taas_magic.writes.landing import Landing
from taas_magic.writes.outbox import FilePart
from taas_magic.writes.rule import WriteRule
from taas_magic.writes.savers import CheckpointSaved

OK, FAILED, STOPPED = "ok", "failed", "stopped"


def ending(error: BaseException | None) -> str:
    """How a run that raised ``error`` (None: nothing) ended, in a word."""
    if error is None:
        return OK
    return STOPPED if isinstance(error, KeyboardInterrupt) else FAILED


def error_lines(error: BaseException | None) -> tuple[str, ...]:
    """The error as the cell shows it (taas's errors render themselves)."""
    if error is None:
        return ()
    if isinstance(error, KeyboardInterrupt):
        return ("KeyboardInterrupt: the run was stopped",)
    render = getattr(error, "_render_traceback_", None)
    if render is not None:
        return tuple(render())
    return tuple("".join(traceback_module.format_exception_only(type(error), error)).splitlines())


@dataclass(frozen=True)
class Held:
    """What the plan step took before the run is made: each one's release is on the plan's stack."""

    settings: RunSettings
    packing: Packing  # the closure as shipped: rank 0's results refer to its untouched tensors
    registered: list  # the registered loaders, by index
    data: DataRun | None  # the data run, when the cell reads registered loaders (its cache folders)
    backend: Backend  # entered: its reserved port, a cluster's placement and agents
    trial: TrialLink | None = None  # a search's trial: its suggestions and its pruning (search/link.py)
    sent: Mapping[str, object] = dataclasses.field(default_factory=dict)  # the closure's values, by name (kept ranks)


class Run:
    """One cell's run: its settings, the closure as shipped, and each part it holds, whole once made."""

    def __init__(self, held: Held, releases: ExitStack, spec: RunSpec, rule: WriteRule, record: LastRun,
                 ranks: RankSet) -> None:
        """Take over ``held`` and its ``releases`` (the plan step's stack, which releases a rank set of one cell),
        then the log, the ranks borrowed, the marker and the closure handoff, in that order; a part that cannot be
        taken releases every one before it, ``held``'s too, and raises. The run borrows ``ranks``' backend, stacks
        folder, layers and server (kernel/runs/rankset.py): what their lifetime does with them is theirs."""
        self.settings, self.packing, self.registered, self.sent = held.settings, held.packing, held.registered, held.sent
        self.data, self.backend, self.trial = held.data, held.backend, held.trial
        self.ranks, self.spec = ranks, spec
        self.on_kept = ranks.running  # planned for ranks already running (kept ones): its closure is partial
        self.rule, self.record = rule, record  # record: for %taas status, the header printed
        self.on_ranks_gone: list[Callable[[], None]] = []  # called as its ranks are gone (a search's slot; did they compile)
        self.saves = Ledger()  # the collective checkpoints its ranks named (writes/savers.py), checked at the end
        # --profile: the ranks' traces, merged and told as the run ends (kernel/runs/profiled.py)
        self.profiles = Profiles(ranks.peers.ranks, spec.profile, not held.backend.loopback_only, spec.run_id) \
            if spec.profile else None
        self._started, self._stack = time.monotonic(), ExitStack()
        self._stack.push(self._drop_results_on_failure)
        self._stack.enter_context(releases)
        self.log = RunLog(spec.run_id)  # its file stays, the record of the run; its last entry closes it
        try:
            self.prompts = PromptDesk(self.log.say, self.log.debugger)  # the ranks' pdb prompts (kernel/supervision/prompts.py)
            self.layers = ranks.layers
            self.peers = PeerIds(ranks.peers.ranks, self.data.workers if self.data is not None else 0)
            self.layers.use_workers(self.peers.workers)  # this cell's data workers' own layers
            ranks.busy_with = spec.run_id
            self._stack.callback(ranks.cell_over)
            self.spec = dataclasses.replace(spec, stacks_dir=ranks.stacks_dir)
            self._stack.callback(self._remove_layers)
            if self.profiles is not None:
                self._stack.callback(self.profiles.finish, self.log.say)
            self.landing = Landing(rule.repository)  # files from hosts that do not see the repository, written into it
            self.marker = None if self.backend.loopback_only else Marker(rule.repository)  # does each host see it
            if self.marker is not None:
                self._stack.callback(self.marker.remove)
            self.server = ranks.server
            self.handoff = ClosureHandoff(self.packing, spec.run_id, spec.result_file_bytes, cuda_ipc=spec.cuda_ipc)
            self._stack.callback(self.handoff.remove)
            self.bodies = [protocol.encode(protocol.Spec(self.spec)), self.handoff.body]
            self._stack.callback(self._ranks_gone)
        except BaseException:
            self.close()
            raise

    # -- what the ranks are started with -------------------------------------------------------
    def launch_plan(self, handshake: str, attempt: int) -> LaunchPlan:
        """Attempt ``attempt``'s ranks: torchrun's variables (restarts too), the owner tag and the session's compile
        cache (compilecache/folder.py) in their environments; each one's place (its id and write rule, applied
        before it has the spec: rank/startup.py) on its stdin; the rest of the run's data is in the spec."""
        envs = rank_environments(self.backend, dict(os.environ), self.spec.run_id)
        for env in envs:
            env.update(TORCHELASTIC_RESTART_COUNT=str(attempt), TORCHELASTIC_MAX_RESTARTS=str(self.settings.restarts))
            env[OWNER_VARIABLE] = self.ranks.owner  # the sweeps' tag of the ranks and of what they start
            if self.spec.compile_cache:
                point_ranks(env, self.spec.compile_cache)
        places = [self._place(rank) for rank in range(self.peers.ranks)]
        files = [stack_file(self.spec.stacks_dir, rank) for rank in range(self.peers.ranks)]
        return LaunchPlan(self.peers.ranks, envs, os.getcwd(), handshake, places, files)

    def _place(self, rank: int) -> wire.Placement:
        layer = self.layers.dirs.get(rank)  # rank 0 has none: it writes to the repository
        marker = self.marker.name if self.marker is not None else None  # a host that does not see it: writes/away.py
        if layer is None and marker is None:
            return wire.Placement(rank, f"rank {rank}")
        return wire.Placement(rank, f"rank {rank}", self.rule.repository, layer, self.rule.mode, marker)

    def heard(self, rank: int, frame: CheckpointSaved | FilePart) -> None:
        """A rank's word on its writes: a collective save's folder (checked at the end), or a piece of a file
        from a host that does not see the repository (written into it now)."""
        if isinstance(frame, FilePart):
            self.landing.receive(rank, frame)
        else:
            self.saves.saw(rank, frame)

    # -- the end ---------------------------------------------------------------------------------
    def __enter__(self) -> "Run":
        self._started = time.monotonic()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.record.seconds = time.monotonic() - self._started
        self.record.outcome = "ok" if error is None else f"{type(error).__name__}: {error}".splitlines()[0]
        try:
            self._stack.__exit__(kind, error, traceback)
        except BaseException as release_error:
            self._log_end(release_error)
            raise
        self._log_end(error)

    def _log_end(self, error: BaseException | None) -> None:
        """The log's last entry, once everything was released: how the run ended, its error as the cell shows it."""
        self.log.end(ending(error), error_lines(error))

    def close(self) -> None:
        """Release everything, its log closed without an ending (a run that never started: no thread for it)."""
        self._stack.close()
        self.log.close()

    def drop_results(self) -> None:
        """Rank 0's results will never be bound (a search's trial that is not the best): their files go now."""
        memfile.remove_run(os.getpid(), self.spec.run_id)

    def bind_results(self, result: Result | None, namespace: dict) -> object:
        """After the run, its parts released: rank 0's results bound in the notebook, their files removed."""
        try:
            final = apply_results(namespace, result, self.packing, self.registered)
            self.ranks.cell_bound(self.sent, result, namespace)
            return final
        finally:  # its one file (an earlier attempt's went between attempts: execution.py), without listing folders
            memfile.remove(result.data.path) if result is not None else memfile.remove_run(os.getpid(), self.spec.run_id)

    def _ranks_gone(self) -> None:
        """The cell's ranks ended it: what they and its workers started and left goes as their lifetime says; and,
        where they are gone (not kept), what waits for that (a search's slot; did they compile)."""
        self.ranks.cell_gone(self.spec.run_id, self.peers.workers)
        for callback in () if self.ranks.keeps_processes else self.on_ranks_gone:
            callback()

    def _remove_layers(self) -> None:
        for line in self.landing.close():  # first: the checkpoints' parts sent from hosts that do not see the repository
            self.log.say(line, "stderr")
        for line in self.saves.report(self.rule.repository, self.peers.ranks):
            self.log.say(line, "stderr")
        lines = self.layers.report(self.rule.repository, tuple(self.saves.folders), self.ranks.lifetime.fate)
        for line in self.ranks.new_lines(lines):  # the layers go with the rank set
            self.log.say(line, "stderr")

    def _drop_results_on_failure(self, kind: type[BaseException] | None, *_: object) -> bool:
        if kind is not None:  # rank 0 may have written its results before the run failed
            memfile.remove_run(os.getpid(), self.spec.run_id)
        return False
