"""The run step: a planned run (kernel/runs/run.py) started and supervised, its parts wired in.

:func:`execute` makes what the supervisor (kernel/supervision/supervisor.py) is given as ``RunParts``
from the run's parts: the handshake line every peer is started with, each peer's greeting
(the spec and closure frames for a rank, its plan for a data worker), the relay into the
run's log, the live board, the hang autopsy over the notebook's sources, the closure
handoff's answer to a rank that asks for a host copy, and whether a stop was asked. It starts the data workers
(when the cell reads registered loaders), then each attempt's ranks (after a failed one,
what it left is swept and a later attempt first recovers the backend's lost hosts), and
returns how the ranks ended. Whatever happens, the board's last reports become ``taas.metrics()``'s.
Everything shown goes into the run's log (output/runlog.py), which the views read; it runs
on the run's own thread (kernel/runs/background.py) and releases nothing: the run releases what
it holds when that thread leaves it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

from taas_magic import wire
from taas_magic.autopsy import stacks
from taas_magic.kernel.runs.run import Run
from taas_magic.kernel.supervision.dataplane import DataPlane
from taas_magic.kernel.supervision.restarts import Attempts
from taas_magic.kernel.supervision.supervisor import RunOutcome, RunParts, run_ranks
from taas_magic.launch.base import ProcessGroup
from taas_magic.output.board import Board
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


def execute(run: Run, stop_asked: Callable[[], bool]) -> RunOutcome:
    """Every rank's environment and the handshake; then the ranks (and data workers), supervised
    until they end or ``stop_asked()``."""
    peers, server, layers, bodies, log = run.peers, run.server, run.layers, run.bodies, run.log
    owner = run.owner
    handshake = wire.Handshake(server.address[0], server.address[1], server.key).line()
    streams: dict[str, TextOut] = {"stdout": log.stream("stdout"), "stderr": log.stream("stderr")}
    data = run.data

    def greeting(peer: Peer) -> list[bytes]:
        if peer.is_rank:
            return bodies
        assert data is not None  # a data worker exists only with a data plan
        return data.greeting(peer.index)

    def start_data() -> DataPlane:
        assert data is not None
        plan = data.prepare(run.spec.run_id, handshake, peers, layers.worker_dirs, run.rule)
        start = functools.partial(data.start, plan, log.publish)
        return run.backend.start_data(data.cache_ram, start, server.key, log.say)

    def start_ranks(attempt: int) -> ProcessGroup:
        if attempt:
            run.backend.recover(log.say)  # a host that went away: its ranks are placed elsewhere
        return run.backend.start_ranks(run.launch_plan(handshake, attempt), server.key, stop_asked)

    def between(attempt: int) -> None:  # a failed attempt's processes are gone: so is what they left
        kill_tagged(owner)
        memfile.remove_run(os.getpid(), run.spec.run_id)

    explain = functools.partial(stacks.autopsy, sources=_notebook_sources(run.spec), cell=run.spec.filename)
    trial = run.trial

    def points(reports: list) -> None:  # rank 0's reports: the log's record, and a trial's objective
        log.points(reports)
        if trial is not None:
            trial.reported(reports)

    board = Board(peers.ranks, log.publish, points)
    parts = RunParts(server, peers, greeting,
                     lambda on_marker: OutputRelay(run.spec.output, peers, streams, on_marker=on_marker),
                     log.publish, run.handoff.answer_host_copy, board, run.settings.timeout, explain, stop_asked,
                     prompts=run.prompts, saves=run.heard)
    if trial is not None:  # a search's trial: its ranks' suggestions, and its pruner's say
        parts = dataclasses.replace(parts, suggest=trial.answer, prune_asked=trial.pruned)
    try:
        return run_ranks(parts, start_ranks, start_data if data is not None else None,
                         Attempts(run.settings.restarts, between, run.backend.standby))
    finally:
        if trial is not None:  # a search's trial: the search says whose reports taas.metrics() gives (the best's)
            trial.metrics = board.metrics()
        else:
            assert run.record is not None  # planned: the session's record of this run
            run.record.metrics = board.metrics()  # a failed run's reports too: what it reached is worth seeing
