"""The run step: a planned run (kernel/runs/run.py) started and supervised, its parts wired in.

Runs in the kernel, on the run's own thread (kernel/runs/background.py). :func:`execute` reads as
its steps, each a named method of :class:`Execution` (as httpx's ``send`` reads as
``_send_handling_auth`` -> ``_send_handling_redirects`` -> ``_send_single_request``):

- :meth:`~Execution.parts`: what the supervisor (kernel/supervision/supervisor.py) is given, built by
  keyword in this one place: the run's rank server and peers, each peer's greeting (the spec and closure
  frames for a rank, its plan for a data worker), the relay into the run's log, the live board, the
  hang autopsy over the notebook's sources, the closure handoff's answer to a rank that asks for a host
  copy, the pdb prompts, the ranks' word on their saves, whether a stop was asked, and a search's
  trial's suggestions and pruner;
- :meth:`~Execution.start_data`: the data workers (when the cell reads registered loaders), started by
  the backend, and their courier on a cluster;
- :meth:`~Execution.start_ranks`: each attempt's ranks (a later attempt first recovers the backend's
  lost hosts);
- :meth:`~Execution.between`: after a failed attempt, what it left is swept.

It returns how the ranks ended. Whatever happens, the board's last reports become ``taas.metrics()``'s.
Everything shown goes into the run's log (output/runlog.py), which the views read. It releases
nothing: the run releases what it holds when its thread leaves it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

from taas_magic import protocol, wire
from taas_magic.autopsy import stacks
from taas_magic.autopsy.hangline import HangWatch
from taas_magic.debugger import panel
from taas_magic.debugger.ranklink import RankLink
from taas_magic.errors import LaunchError
from taas_magic.kernel.runs.run import Run
from taas_magic.kernel.supervision.attempts import run_ranks
from taas_magic.kernel.supervision.dataplane import DataPlane
from taas_magic.kernel.supervision.restarts import Attempts
from taas_magic.kernel.supervision.supervisor import MarkerHook, RunOutcome, RunParts, never, not_a_search
from taas_magic.launch.contract import ProcessGroup
from taas_magic.output.board import Board, health_by_rank
from taas_magic.output.relay import OutputRelay, TextOut
from taas_magic.peers import Peer
from taas_magic.procs import kill_tagged
from taas_magic.runspec import RunSpec
from taas_magic.transfer import memfile


def _notebook_sources(spec: RunSpec) -> dict[str, tuple[str, list[str]]]:
    """The cell's lines and earlier cells' (the autopsy shows frames there at their cell lines)."""
    sources = {name: (f"Cell In[{number}]", lines) for name, (number, lines) in spec.cells.items()}
    sources[spec.filename] = ("Cell", spec.display_source.splitlines())
    return sources


def _panel_link(run: Run) -> RankLink | None:
    """The run's ranks as the debugger panel's threads, in a kernel whose panel is on (debugger/panel.py); None while
    it is off: nothing is published (a thread that publishes on IOPub gets sockets of its own), nothing is held."""
    found = panel.current()
    return found.for_run(run.peers.ranks) if found is not None and found.on and run.trial is None else None


class Execution:
    """One run's wiring: its parts, and the steps the supervisor takes through them."""

    def __init__(self, run: Run, stop_asked: Callable[[], bool]):
        self.run, self.stop_asked = run, stop_asked
        server = run.server
        self.handshake = wire.Handshake(server.address[0], server.address[1], server.key).line()
        self.board = Board(run.peers.ranks, run.log.publish, self.points)

    def parts(self) -> RunParts:
        """What supervising the run takes, each by name."""
        run, log, trial = self.run, self.run.log, self.run.trial
        sources = _notebook_sources(run.spec)
        return RunParts(
            server=run.server, ids=run.peers, greeting=self.greeting, relay=self.relay, publish=log.publish,
            host_copy=run.handoff.answer_host_copy, board=self.board, timeout=run.settings.timeout,
            explain=functools.partial(stacks.autopsy, sources=sources, cell=run.spec.filename),
            hang=HangWatch(run.settings.hang, sources, run.spec.filename) if run.settings.hang else None,
            stop_asked=self.stop_asked, prompts=run.prompts, saves=run.heard,
            profiled=run.profiles.add if run.profiles is not None else None,
            panel=_panel_link(run),
            suggest=trial.answer if trial is not None else not_a_search,
            prune_asked=trial.pruned if trial is not None else never,
        )

    def greeting(self, peer: Peer) -> list[bytes]:
        """The frames a peer gets once connected: the spec and the closure for a rank, its plan for a data worker."""
        if peer.is_rank:
            return self.run.bodies
        assert self.run.data is not None  # a data worker exists only with a data plan
        return self.run.data.greeting(peer.index)

    def relay(self, on_marker: MarkerHook) -> OutputRelay:
        """The ranks' output into the run's log, with the supervisor's hook for each display's marker."""
        log = self.run.log
        streams: dict[str, TextOut] = {"stdout": log.stream("stdout"), "stderr": log.stream("stderr")}
        return OutputRelay(self.run.spec.output, self.run.peers, streams, on_marker=on_marker)

    def points(self, reports: list) -> None:
        """Rank 0's reports: the log's record, and a trial's objective."""
        self.run.log.points(reports)
        if self.run.trial is not None:
            self.run.trial.reported(reports)

    def start_data(self) -> DataPlane:
        """The data workers, started by the backend with their plan, and what carries their elements."""
        run, data = self.run, self.run.data
        assert data is not None
        plan = data.prepare(run.spec.run_id, self.handshake, run.peers, run.layers.worker_dirs, run.rule)
        workers = run.backend.start_workers(plan, run.server.key, data.cache_dirs())
        courier = run.backend.courier(data.cache_ram, run.log.say)
        where = run.backend.workers_layout()
        if where is not None:
            run.log.say(where)
        return data.start(workers, courier, run.log.publish)

    def start_ranks(self, attempt: int) -> ProcessGroup:
        """Attempt ``attempt``'s ranks; a host of a failed attempt that went away: its ranks are placed elsewhere."""
        if attempt:
            self.run.backend.recover(self.run.log.say)
        return self.run.backend.start_ranks(self.run.launch_plan(self.handshake, attempt), self.run.server.key,
                                            self.stop_asked)

    def replace_rank(self, rank: int, joins: str | None) -> None:
        """A new process in kept rank ``rank``'s place (it died), started as the first cell's was; ``joins``: the
        run after which the survivors renew their default group, which it joins (None: they have none)."""
        plan = self.run.launch_plan(self.handshake, 0)
        envs = [dict(env) for env in plan.envs]
        if joins is not None:
            envs[rank][protocol.JOIN_VARIABLE] = joins
        group = self.run.ranks.ranks.group
        assert group is not None, "only a started rank dies"
        group.replace(rank, dataclasses.replace(plan, envs=envs))

    def between(self, attempt: int) -> None:
        """A failed attempt's processes are gone: so is what they left."""
        kill_tagged(self.run.ranks.owner)
        memfile.remove_run(os.getpid(), self.run.spec.run_id)


def execute(execution: Execution) -> RunOutcome:
    """The ranks (and data workers) of the execution's run, supervised until they end or a stop is asked."""
    run = execution.run
    try:
        if run.on_kept and not run.ranks.running:  # its closure has only what those ranks lacked
            raise LaunchError("taas: the kept ranks ended after this cell was planned (a rank died): run the cell "
                              "again, and new ranks start")
        attempts = Attempts(run.settings.restarts, execution.between, run.backend.standby)
        policy = run.ranks.lifetime.policy(run.ranks, execution.start_ranks, attempts, run.spec.run_id,
                                           execution.replace_rank)
        return run_ranks(execution.parts(), policy, execution.start_data if run.data is not None else None)
    finally:
        run.ranks.health = health_by_rank(execution.board)  # %taas status says it of kept ranks
        if run.trial is not None:  # a search's trial: the search says whose reports taas.metrics() gives (the best's)
            run.trial.metrics = execution.board.metrics()
        else:
            run.record.metrics = execution.board.metrics()  # a failed run's reports too: what it reached is worth seeing
