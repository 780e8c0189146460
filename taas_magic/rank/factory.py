"""The spare factory: one process that imports torch once and forks every warm spare from itself.

Runs in the spare factory (``python -m taas_magic.rank --spare --factory FD``, started by the
kernel: launch/local/sparefactory.py), on its one thread; each fork becomes a spare and runs
rank/main.py.

Importing torch is most of what a spare costs (1 to 2 s here, 3 to 4 s with a CUDA build),
and the pool starts new spares the moment a cell's ranks are gone: a cell run right after
another used to wait for that import. The kernel's pool (launch/local/sparefactory.py) starts this
process once, with OpenMP and OpenBLAS at one thread; it imports what a spare imports and,
on a host without GPUs, takes the spare's first CPU training step (about 1 s of lazy
imports and first-call set-up) and nothing else. When a cell's rank already waits for a fork
as its imports end, the step waits instead: the factory serves the waiting forks first and
takes the step once they have ended (the cell no longer needs the CPU) and no request waits, so
that only those first forks take the step themselves (IMPORTANT: skipping it for good made every
later spare pay about 0.8 s of its own step, which a cell sent right after another waited for;
with no child alive, a step that left threads behind ends only the factory). No CUDA (a forked
CUDA context is broken, an imported CUDA library is not; on a GPU host even the CPU step
would start the driver, so there each spare takes it). It stays single-threaded, and a fork of it is a
warm spare in a few milliseconds, as ``multiprocessing``'s forkserver with preloaded modules is.

Its requests and answers are messages on a ``SOCK_SEQPACKET`` socket (``--factory FD``):

    kernel -> factory : {"gpu": K|None, "visible": V|None, "cwd": ..., "for_cell": B} with three fds:
                        the spare's stdin (read end), stdout and stderr (write ends)
    factory -> kernel : {"ready": true}                   its imports are done
                        {"spawned": PID}                  the spare asked for
                        {"exited": PID, "code": CODE}     a spare ended (negative: its signal)

A forked spare starts its own session, puts the three fds on 0, 1 and 2, and from there is
a spare like any other (rank/spare.py): warm-up, handshake, cell. Its parent is this
process, which reaps it and reports its exit code, so the factory outlives its spares: it
leaves when the kernel closes its stdin (the kernel is gone; its spares' lifelines end them
too) or after ``{"retire": true}`` once its last spare has ended.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback
import warnings
from typing import NoReturn

from taas_magic.procs import exit_fd
from taas_magic.rank import spare
from taas_magic.rank.spare import WARM_MODULES, set_name

FACTORY_NAME = b"taas-factory"
FORKED_NAME = b"taas-warming"  # a forked spare until its warm-up ends (then taas-spare)
MESSAGE_BYTES = 64 * 1024
# what every fork imports next, between its fork and its rank's first line (the rank's runtime; numpy's
# generator, which a fork reseeds; the codec a connection to "localhost" loads): about 40 ms a fork here,
# on the critical path of a first cell whose ranks wait for their forks
FORK_MODULES = ("taas_magic.rank.main", "numpy.random", "encodings.idna")
# a compiler factory's (the session compiles: launch/local/spares.py) modules, warmed before its forks: about 84%
# of a cached compile in a new process here is these imports and the CPU probe (docs/benchmarks.md)
COMPILER_MODULES = ("torch._dynamo", "torch._inductor.compile_fx")  # private API: see taas_magic/private.py
EXIT_POLL_SECONDS = 0.05  # where no pidfd wakes the factory (an old kernel), how often it looks for exits


def serve(control: socket.socket, step: bool, compiler: bool = False) -> NoReturn:
    """Import (and with ``step``, take the first CPU step; with ``compiler``, warm torch's compiler), say
    so, then fork a spare per request and report each one's exit, until told to leave."""
    from taas_magic.rank.lifeline import PR_SET_PDEATHSIG, prctl

    set_name(FACTORY_NAME)
    kernel = os.getppid()
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))  # not Linux: its stdin's end-of-file alone
    if os.getppid() != kernel:
        os._exit(0)
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken torch: each spare finds out and the cell says so
            step = False
            break
    else:
        for name in FORK_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - numpy is optional: a fork imports what it needs itself
                pass
        if step and not _request_waiting(control):  # a cell's rank waits for its fork: its step comes later
            _take_first_step()
            step = False
    if compiler and not warm_compiler():
        os._exit(4)  # a compiler factory that cannot warm is of no use: the kernel keeps the one it has
    if _threads() != 1:
        os._exit(3)  # a fork of a threaded process may inherit a held lock: the kernel starts spares fresh
    control.send(json.dumps({"ready": True}).encode())
    children: dict[int, int | None] = {}  # pid -> its pidfd, which wakes the select the moment it exits
    retiring = False
    while not (retiring and not children):
        exit_fds = [fd for fd in children.values() if fd is not None]
        readable, _, _ = select.select([control, sys.stdin.fileno(), *exit_fds], [], [], EXIT_POLL_SECONDS)
        if sys.stdin.fileno() in readable and not os.read(sys.stdin.fileno(), 1):
            os._exit(0)  # the kernel is gone; its spares' lifelines end them as well
        if control in readable:
            retiring = _answer(control, children, retiring) or retiring
        _report_exits(control, children)
        if step and not children and not retiring and not _request_waiting(control):
            _take_first_step()  # the forks a cell waited for have ended: the spares forked from now on skip it
            step = False
    os._exit(0)


def _take_first_step() -> None:
    """The spare's first CPU step, in the factory (once: a failed step is not tried again, and each spare
    then takes its own); the factory must still be single-threaded after it, since it forks. Taken with
    no child alive, so that an exit here leaves no spare without the parent that reports its exit."""
    spare.first_step_taken = spare.first_step("cpu")
    if _threads() != 1:
        os._exit(3)  # as at start: the kernel starts spares fresh


def warm_compiler() -> bool:
    """What every new process pays before its first ``torch.compile``, whatever the caches hold, paid once
    here: importing Dynamo, AOTAutograd and Inductor, and Inductor's probe of the CPU's vector instructions
    (it builds and loads a test library in a fresh interpreter; its answer is kept in the process). Whether
    it worked and left the factory fit to fork: one thread, and no CUDA started."""
    try:
        with warnings.catch_warnings():  # torch's own deprecations as Inductor imports: not the person's code
            warnings.simplefilter("ignore", DeprecationWarning)
            for name in COMPILER_MODULES:
                importlib.import_module(name)
        from torch._inductor import cpu_vec_isa  # private API: see taas_magic/private.py

        cpu_vec_isa.pick_vec_isa()
        import torch

        return not torch.cuda.is_initialized() and _threads() == 1
    except Exception:  # noqa: BLE001 - an optimisation: the cell compiles without it
        return False


def _answer(control: socket.socket, children: dict[int, int | None], retiring: bool) -> bool:
    """One request: fork the spare it asks for (True: retire instead; once retiring, fork no more)."""
    try:
        message, fds, _, _ = socket.recv_fds(control, MESSAGE_BYTES, 3)
    except OSError:
        os._exit(0)
    if not message:
        os._exit(0)  # the kernel closed its end
    request = json.loads(message)
    if request.get("retire") or retiring:
        for fd in fds:
            os.close(fd)
        if not request.get("retire"):
            control.send(json.dumps({"refused": True}).encode())
        return True
    sys.stdout.flush()
    sys.stderr.flush()
    started, leads = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(started)
        os.setsid()  # before the kernel hears of it: it stops a spare by signalling its session's group
        os.close(leads)
        _close_exit_fds(children)  # the factory's watch on its other spares is not this spare's
        _become_spare(control, fds, request)
    os.close(leads)
    os.read(started, 1)  # end-of-file once the child leads its session
    os.close(started)
    for fd in fds:
        os.close(fd)
    children[pid] = exit_fd(pid)
    control.send(json.dumps({"spawned": pid}).encode())
    return False


def _report_exits(control: socket.socket, children: dict[int, int | None]) -> None:
    """Reap every spare that ended and tell the kernel its exit code (a rank's end is the run's:
    it is reported the moment the pidfd says so, not at the next poll)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            _close_exit_fds(children)
            children.clear()
            return
        if pid == 0:
            return
        fd = children.pop(pid, None)
        if fd is not None:
            os.close(fd)
        try:
            control.send(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        except OSError:
            pass  # the kernel is gone


def _close_exit_fds(children: dict[int, int | None]) -> None:
    for fd in children.values():
        if fd is not None:
            os.close(fd)


def _become_spare(control: socket.socket, fds: list[int], request: dict) -> NoReturn:
    """In the forked child: a spare of its own session on its own pipes; never returns to the factory."""
    code = 1
    try:
        set_name(FORKED_NAME)
        control.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        see_gpus(request.get("visible"))
        spare.for_cell = bool(request.get("for_cell"))  # a cell's rank waits for it: no warm-up step
        os.chdir(request["cwd"])
        _fresh_randomness()
        gpu = request.get("gpu")
        sys.argv = [sys.argv[0], "--spare", *(["--gpu", str(gpu)] if gpu is not None else [])]
        from taas_magic.rank.main import main

        main()  # ends in os._exit
    except SystemExit as exc:  # as the interpreter would end: a number is the code, anything else is printed
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - whatever happens, this process never returns into the factory
        traceback.print_exc()
    finally:
        from taas_magic.rank import lifeline

        lifeline.end_watchdog()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def see_gpus(visible: str | None) -> None:
    """Before anything starts CUDA, the GPUs this spare's CUDA will see: its binding's
    ``CUDA_VISIBLE_DEVICES`` ("" for a ``--device cpu`` spare, "2,3" for a search trial's
    slice), or the factory's own (None)."""
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible


def _request_waiting(control: socket.socket) -> bool:
    """Whether a spawn request already waits (a cell's rank sent it while this process imported)."""
    return bool(select.select([control], [], [], 0)[0])


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()  # not Linux: Python's threads are what can be counted


def _fresh_randomness() -> None:
    """Python's ``random`` reseeds itself in a fork; numpy's global generator does not, and every
    spare would draw the factory's numbers: reseed it from the OS, as a fresh process is."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
