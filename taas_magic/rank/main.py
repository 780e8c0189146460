"""A rank's life: lifeline, authenticated handshake, the cell, what goes back, exit.

Runs in each rank (``python -m taas_magic.rank``, or a spare once a cell takes it), on its main
thread, which runs the cell.

The kernel starts ``python -m taas_magic.rank`` with the rank's environment (RANK,
WORLD_SIZE, ...), its own pipes for stdout/stderr, and writes ``HOST PORT KEY`` on
stdin. The rank then:

1. starts as every process the kernel starts does (startup.py): watchdog, handshake, the
   write rule (ranks other than 0 get their copy-on-write view of the repository),
   lifeline, the authenticated channel;
2. receives the run spec and the closure (both verified before unpickling; the closure's
   tensor bytes are mapped from one shared memory file, not copied: transfer/); from the
   spec on, the kernel can read where the rank is (the hang autopsy, autopsy/dump.py), and
   the run's data (checkpoint folder, seed) comes from the spec, never the environment;
3. runs the cell in a fresh ``__main__`` module (so pickling ``__main__.Net`` works), with what the
   session's earlier cells compiled at hand (compilecache/artifacts.py), and saves what it compiled;
4. every rank gathers the sharded names its cell bound (transfer/sharded.py: the default group's
   destroy waits for that, rank/groups.py), and rank 0 sends back what the cell bound
   (transfer/returns.py); a failing rank sends its traceback; a rank on a host that does not see
   the repository also sends what it wrote for it (writes/outbox.py): last, or before its traceback;
5. exits through ``startup.finish`` (0, or 1 when the cell raised), so no atexit hook or
   non-daemon thread of the cell can hang the run; or, kept (``--keep``), says ``CellDone`` and waits
   for the next cell's spec and closure, its ``__main__`` and its process group as the cell left them
   (rank/betweencells.py), until the kernel lets it go.
"""

from __future__ import annotations

import functools
import io
import os
import signal
import sys
import types
from typing import Any, Callable

from taas_magic.autopsy import dump as stacks
from taas_magic.autopsy import waiting
from taas_magic.compilecache import artifacts as compiled
from taas_magic.debugger import tracer as panel_tracer
from taas_magic.debugger.ranklink import PanelNow
from taas_magic.import_hooks import when_imported
from taas_magic.output import collectives, ddptiming, reports
from taas_magic.profiling import window as profiling
from taas_magic.protocol import JOIN_VARIABLE, Abandon, Hold, Interrupt, PeerChannel, RankError, Spec, ToKernel
from taas_magic.rank import betweencells, cellpdb, execute, groups, heal, identity, lifeline, lightning, shell, startup, steps
from taas_magic.rank.inbox import Inbox
from taas_magic.runspec import RunSpec
from taas_magic.search import trial as search_trial
from taas_magic.search.trial import Suggest, Suggested
from taas_magic.transfer import cudaipc, memfile, returns, sharded
from taas_magic.transfer.handoff import ReceivedClosure, receive_closure
from taas_magic.writes import checkpoints, outbox, refresh, savers, unseen

EXIT_CELL_RAISED = 1
FLUSH_SECONDS = 0.05
STDOUT_BUFFER = 1 << 16


class CellFailed(Exception):
    """The cell, or what follows it, failed and said so to the kernel: the rank exits with ``code``, or,
    kept (``--keep``), waits for the next cell."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _send_error(channel: PeerChannel, summary: str, text: str,
                signature: tuple[str, str, int] | None = None, frames: tuple = ()) -> None:
    # The kernel stops every rank as soon as it reads this report: an interrupt
    # arriving now must not bury the report under a second traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    startup.flush_output()
    reports.flush()
    outbox.ship(channel.send)  # on a host that does not see the repository: its saves so far, before the report
    try:
        channel.send(RankError(summary, text, signature, frames))
    except OSError:
        pass  # the kernel already stopped listening (it is stopping us): nobody to tell


def _own_output() -> None:
    """stdout gets a 64 kB buffer, as a file is buffered (even under PYTHONUNBUFFERED, which the
    kernel's environment may carry), so a print loop costs what printing to a file does; a
    daemon thread flushes it every 50 ms, so output still arrives live."""
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False), STDOUT_BUFFER),
        encoding=sys.stdout.encoding, errors=sys.stdout.errors,
    )
    if isinstance(sys.stderr, io.TextIOWrapper):  # it is, unless something replaced it before we ran
        sys.stderr.reconfigure(line_buffering=True)
    lifeline.flush_periodically(sys.stdout, FLUSH_SECONDS)


def _rank_module(spec: RunSpec, channel: PeerChannel, rank: int) -> types.ModuleType:
    """Once per rank: a fresh ``__main__`` for its cells, IPython's stand-ins, the rank's device, the hooks."""
    away = outbox.away()
    reports.start(channel, lambda now: {**waiting.figures(now, away), **collectives.figures(now)})  # the lines' figures
    collectives.install(spec.device == "cuda", when_imported)  # each rank's time in collectives: the straggler line
    when_imported("torch.optim.optimizer", steps.install)  # its steps: the straggler line's, --profile's marks
    steps.listeners += [collectives.clock.step, functools.partial(profiling.mark, "optimizer")]
    if spec.device != "cuda":  # DDP's all-reduce read after a step (a cell with no optimizer's: a report); CUDA: NCCL's
        steps.listeners.append(ddptiming.times.after_step)
        reports.after_report = ddptiming.times.after_step
    when_imported("torch.distributed", cellpdb.distributed_breakpoint)
    if spec.keep:
        groups.keep_across_cells(abortable=spec.device != "cuda")  # their groups outlive a cell, even a failed one
        when_imported("torch.nn.parallel.distributed", heal.note_builtin_hooks)  # a built-in hook heal registers again
    when_imported("torch.distributed", groups.defer_destroy)  # the default group outlives the cell's sharded names' gather
    when_imported("torch.distributed", refresh.follow_collectives)  # past a collective, rank 0's writes are seen here
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = module
    shell.configure(module, channel.send if rank == 0 or spec.output == "all" else None)  # before IPython's hook
    when_imported("IPython", shell.on_ipython_import)
    for package in ("lightning.pytorch", "pytorch_lightning"):
        # self.log(...) in the live chart
        when_imported(package, functools.partial(lightning.add_to_trainers, report=reports.report))
    if spec.device == "cuda":
        from taas_magic.rank.devices import bind_gpu

        bind_gpu()
    else:
        from taas_magic.rank.devices import serve_nccl_with_gloo

        when_imported("torch.distributed", serve_nccl_with_gloo)
    if spec.compile_cache:  # what the session's earlier cells compiled, where this rank's caches are elsewhere
        compiled.load_when_compiling(spec.compile_cache, rank)
    if spec.keep and JOIN_VARIABLE in os.environ:  # a new process in a dead kept rank's place: the survivors' group
        groups.join_survivors(os.environ.pop(JOIN_VARIABLE))
    return module


def _cell_setup(spec: RunSpec, inbox: Inbox, module: types.ModuleType, rank: int) -> None:
    """Each cell: its run's data (seed, checkpoints, savers' folders), its trial, its prompt, its sources,
    where its displays go (rank 0's, or every rank's with --output all)."""
    channel = inbox.channel
    refresh.refresh()  # the repository as rank 0 has left it (a kept rank's last look was in the cell before)
    steps.new_cell()  # its first optimizer paces its steps
    collectives.clock.new_cell()  # a collective the last cell left in flight is not this one's wait
    unseen.mark(spec.repository_names)  # on a host that does not see it: its files named, a clear line on reading one
    shell.configure(module, channel.send if rank == 0 or spec.output == "all" else None)
    identity.enter(spec.device, spec.seed, _reporter(spec))  # what the cell's `import taas` answers by
    checkpoints.use_run(spec.checkpoints, spec.keep_checkpoints)
    savers.install(outbox.for_kernel(channel.send), spec.shared)  # collective checkpoints: every rank's part in place (writes/)
    search_trial.start(spec.trial, functools.partial(_ask, inbox))  # taas.trial(): a search's, or defaults
    cellpdb.install(cellpdb.DebugLink(rank, inbox, spec.post_mortem, spec.filename))  # breakpoint(): the cell's prompt
    execute.register_source(spec.filename, spec.display_source)
    execute.register_cells(spec.cells)


def _reporter(spec: RunSpec) -> Callable[..., None]:
    """``taas.report``: with ``--profile``, each call also marks a step (profiling/window.py)."""
    if not spec.profile:
        return reports.report

    def report(step: Any = None, **metrics: Any) -> None:
        profiling.mark("report")
        reports.report(step, **metrics)
    return report


def _profiled(spec: RunSpec, inbox: Inbox, module: types.ModuleType, rank: int) -> object:
    """The cell run (``_run``), with ``--profile``: its window recorded, torn down whatever happens, and sent
    when the cell finished; a trace that cannot be sent is said on the rank's stderr, never failing the cell."""
    if not spec.profile:
        return _run(spec, inbox, module)
    try:
        profiling.begin(spec.profile, spec.device == "cuda")
    except Exception as exc:  # noqa: BLE001 - the cell runs all the same, unprofiled, and says so
        print(f"taas: --profile: rank {rank} could not start its profiler: {type(exc).__name__}: {exc}", file=sys.stderr)
    try:
        final = _run(spec, inbox, module)
    finally:
        window = profiling.end()  # a kept rank's next cell starts with no profiler running
    try:
        if window is not None:
            window.send(inbox.send, functools.partial(_answer, inbox), rank, int(os.environ.get("WORLD_SIZE", "1")))
    except Exception as exc:  # noqa: BLE001 - the cell succeeded; its profile is lost, and said so
        print(f"taas: --profile: rank {rank} could not send its trace: {type(exc).__name__}: {exc}", file=sys.stderr)
    return final


def _answer(inbox: Inbox, frame: ToKernel, kind: type) -> Any:
    """The kernel's answer of type ``kind`` to ``frame``, taken from the channel's one reader; None after
    ``CLOCK_WAIT`` seconds (the kernel's clock, asked by --profile)."""
    inbox.send(frame)
    return inbox.take(lambda reply: isinstance(reply, kind), timeout=profiling.CLOCK_WAIT)


def _ask(inbox: Inbox, frame: Suggest) -> Suggested:
    """A trial's suggestion: asked of the kernel, its answer taken from the channel's one reader."""
    inbox.send(frame)
    answer = inbox.take(lambda reply: isinstance(reply, Suggested) and reply.name == frame.name)
    assert isinstance(answer, Suggested)
    return answer


def _load_closure(spec: RunSpec, channel: PeerChannel, inbox: Inbox, received: ReceivedClosure) -> tuple[dict, dict]:
    """The closure's values, and the prepared loaders by feed index; reports and exits if they cannot load."""
    try:
        from taas_magic.rank.loaders import prepared_loaders

        loaders = prepared_loaders(spec.feeds, inbox)
        return received.load(loaders.__getitem__), loaders
    except BaseException as exc:  # noqa: BLE001 - reported to the kernel, then we exit
        _send_error(channel, f"could not load the cell's closure: {type(exc).__name__}: {exc}",
                    execute.format_cell_traceback(exc, spec.filename))
        raise CellFailed(EXIT_CELL_RAISED) from None


def _run(spec: RunSpec, inbox: Inbox, module: types.ModuleType) -> object:
    """The cell's final value (or NO_VALUE); a cell that raises is reported, and the rank exits."""
    channel = inbox.channel
    tracer = panel_tracer.install(inbox, spec.panel, spec.filename)  # JupyterLab's debugger panel: none while it is off
    try:
        if spec.keep:
            betweencells.cell_starts(spec.run_id)  # SIGINT raises in the cell's code only: the rank outlives it
        if tracer is not None:
            tracer.start()  # its breakpoints hold from the cell's first line
        final = execute.run_cell(spec.source, spec.filename, module)
        if tracer is not None:
            tracer.finish()
        if spec.keep:
            betweencells.cell_ends()
        cellpdb.cell_ended()
        shell.after_cell()
        return final
    except SystemExit as exc:
        if tracer is not None:
            tracer.finish()
        if spec.keep:
            betweencells.cell_ends()
        if exc.code not in (None, 0):
            _send_error(channel, f"called sys.exit({exc.code!r})", execute.format_cell_traceback(exc, spec.filename))
            raise CellFailed(exc.code if isinstance(exc.code, int) else EXIT_CELL_RAISED) from None
        return execute.NO_VALUE
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: the kernel asked us to stop
        if tracer is not None:
            tracer.finish()
        cellpdb.cell_ended()
        if cellpdb.wants_post_mortem(exc):  # %pdb on: a prompt at the failing frame, the other ranks held
            try:
                cellpdb.post_mortem(exc)
            except BaseException:  # noqa: BLE001 - the kernel's stop ended it (an interrupt): report all the same
                pass
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the report goes out whole (see _send_error)
        _send_error(channel, f"raised {type(exc).__name__}: {exc}", execute.format_cell_traceback(exc, spec.filename),
                    execute.signature(exc, spec.filename), _frames(exc, spec.filename))
        raise CellFailed(EXIT_CELL_RAISED) from None


def _frames(error: BaseException, filename: str) -> tuple:
    """The failing frames' locals for %debug; nothing rather than a second error."""
    try:
        return tuple(cellpdb.frames_with_locals(error, filename))
    except BaseException:  # noqa: BLE001 - the error report matters more than its locals
        return ()


def _cell_results(spec: RunSpec, namespace: dict, before: dict[str, int], final: object) -> returns.CellResults:
    """Every rank: what the cell bound or changed since ``before`` (its snapshot), what it deleted, and
    its final value unless there is none or the cell ends with ``;``."""
    private = shell.hidden_names() | {"get_ipython", "__builtins__"}
    names, deleted = returns.changed_names(namespace, before, private)
    has_final = final is not execute.NO_VALUE and not spec.suppress_final
    return returns.CellResults(namespace, names, deleted, final, has_final)


def _bring_whole(spec: RunSpec, channel: PeerChannel, results: returns.CellResults, closure: dict,
                 rank: int) -> tuple[returns.CellResults, dict]:
    """Every rank: sharded names gathered whole for rank 0 (transfer/sharded.py), then the
    default group's deferred destroy done (rank/groups.py)."""
    try:
        return sharded.bring_whole(results, closure, spec, rank)
    except Exception as exc:  # noqa: BLE001 - the cell succeeded; say why its results cannot follow
        _send_error(channel, f"could not gather its sharded names: {type(exc).__name__}: {exc}",
                    execute.format_cell_traceback(exc, spec.filename))
        raise CellFailed(EXIT_CELL_RAISED) from None
    finally:
        groups.finish_destroy()


def _send_results(spec: RunSpec, inbox: Inbox, results: returns.CellResults, closure: dict,
                  received: ReceivedClosure, loaders: dict) -> None:
    """Rank 0: the cell's ``results`` sent back (transfer/returns.py), the shipped ``closure`` as
    loaded from what the rank ``received``, ``loaders`` by feed index; ``inbox``: the rank's channel (rank/inbox.py)."""
    externals = [loaders.get(index) for index in range(max(loaders, default=-1) + 1)]
    why: str | None = None
    for attempt in range(2):  # a second time only when the kernel did not take the CUDA IPC handles
        try:
            if attempt == 0:
                returned = returns.pack_returns(results, closure, received, externals, spec)
            message = returned.message(spec.cuda_ipc and attempt == 0, why or "")
        except Exception as exc:  # noqa: BLE001 - the cell succeeded; say why its results cannot follow
            _send_error(inbox.channel, f"could not send back its results: {type(exc).__name__}: {exc}",
                        execute.format_cell_traceback(exc, spec.filename))
            raise CellFailed(EXIT_CELL_RAISED) from None
        startup.flush_output()
        inbox.send(message)
        if not message.ipc:
            return
        why = returns.await_kernel(inbox.take)  # our CUDA storages stay alive until the kernel has its copies
        cudaipc.forget_counters(message.ipc)
        if why is None:
            return
        memfile.remove(message.data.path)  # the kernel dropped that message: the second one has every byte


def _one_cell(spec: RunSpec, inbox: Inbox, module: types.ModuleType, received: ReceivedClosure, rank: int) -> None:
    """The cell: its setup, its closure loaded into ``module``, run, its sharded names gathered, rank 0's
    results sent. Raises CellFailed once a failure was reported."""
    channel = inbox.channel
    sys.path[:] = spec.sys_path
    _cell_setup(spec, inbox, module, rank)
    closure, loaders = _load_closure(spec, channel, inbox, received)
    module.__dict__.update(closure)
    module.__dict__.setdefault("get_ipython", shell.get_ipython)
    before = returns.snapshot(module.__dict__)  # every rank: the names its cell binds, for the gather
    final = _profiled(spec, inbox, module, rank)  # --profile: its window sent (profiling/window.py)
    if spec.compile_cache:
        compiled.save(spec.compile_cache, rank)  # what it compiled, for the session's next ranks
    savers.finish()  # a pending async_save's parts are whole before the rank ends
    reports.flush()  # the last reports reach the chart before the results
    results, closure = _bring_whole(spec, channel, _cell_results(spec, module.__dict__, before, final), closure, rank)
    if rank == 0:
        _send_results(spec, inbox, results, closure, received, loaders)


def main() -> None:
    channel = startup.begin(spare="--spare" in sys.argv)
    rank = int(os.environ["RANK"])
    spec = outbox.here(channel.expect(Spec).spec)  # the kernel sends it as soon as we connect (its folders as this host has them)
    stacks.arm(stacks.stack_file(spec.stacks_dir, rank) if spec.stacks_dir else "")  # the hang autopsy, from here on
    received = receive_closure(channel, keep_original=rank == 0, own_gpu=spec.device == "cuda")
    sys.path[:] = spec.sys_path
    sys.argv = ["taas-rank"]
    _own_output()
    inbox = Inbox(channel, {Hold: cellpdb.on_hold, Interrupt: betweencells.interrupted,  # its one reader (rank/inbox.py)
                            Abandon: betweencells.abandoned, PanelNow: panel_tracer.now})
    if spec.keep:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # until the cell's code begins (rank/betweencells.py)
    module = _rank_module(spec, channel, rank)
    cell: tuple[RunSpec, ReceivedClosure] | None = (spec, received)
    while cell is not None:
        spec, received = cell
        try:
            _one_cell(spec, inbox, module, received, rank)
            raised = False
        except CellFailed as failed:
            if not spec.keep:
                startup.finish(failed.code)
            raised = True
        if not spec.keep:
            break
        try:
            cell = betweencells.between_cells(inbox, raised, rank, module.__dict__)  # None: the kernel let the kept ranks go
        except Exception as exc:  # noqa: BLE001 - the next cell cannot come: said, and the rank ends
            _send_error(channel, f"could not receive the next cell: {type(exc).__name__}: {exc}",
                        execute.format_cell_traceback(exc, spec.filename))
            startup.finish(EXIT_CELL_RAISED)
    outbox.ship(channel.send)  # on a host that does not see the repository: what the rank wrote for it (writes/)
    channel.close()
    startup.finish(0)
