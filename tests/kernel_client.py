"""Drive a real IPython kernel through jupyter_client and collect its iopub messages.

Modelled on ipykernel's tests/utils.py: execute, gather every iopub message whose
parent is our request until the kernel is idle again, and keep their arrival times.
"""

from __future__ import annotations

import os
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import psutil
from jupyter_client.manager import KernelManager
from jupyter_core.paths import jupyter_runtime_dir

# Each test process marks its environment. What it starts inherits the mark (kernels, their ranks and spares, a
# Ray cluster's workers and the ranks its agents start), so a look at every process on the machine keeps only
# this test process's own while another one (a second pytest-xdist worker, say) runs cells
# of its own beside it. An exited process whose parent has not yet read its status shows an empty environment.
TEST_PROCESS_MARK = "TAAS_TEST_PROCESS"
os.environ[TEST_PROCESS_MARK] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"


def started_here(process: psutil.Process) -> bool:
    """Whether ``process`` was started, directly or not, by this test process (it carries its mark)."""
    try:
        return process.environ().get(TEST_PROCESS_MARK) == os.environ[TEST_PROCESS_MARK]
    except psutil.Error:
        return False


@dataclass
class Message:
    at: float  # seconds after the execute request
    type: str
    content: dict


@dataclass
class Execution:
    reply: dict
    reply_at: float
    messages: list[Message] = field(default_factory=list)

    def stream(self, name: str | None = None) -> str:
        return "".join(m.content["text"] for m in self.messages if m.type == "stream" and name in (None, m.content["name"]))

    def of_type(self, kind: str) -> list[Message]:
        return [m for m in self.messages if m.type == kind]

    @property
    def error(self) -> dict | None:
        errors = self.of_type("error")
        return errors[0].content if errors else None

    @property
    def result(self) -> dict | None:
        results = self.of_type("execute_result")
        return results[0].content["data"] if results else None

    def error_text(self) -> str:
        return "\n".join(self.error["traceback"]) if self.error else ""


class Kernel:
    def __init__(self, kernel_name: str = "python3", load_ext: bool = True, cwd: str | None = None,
                 env: dict[str, str] | None = None):
        # IPC sockets in the owner-only runtime directory, as notebooks/run.py: a kernel on TCP without
        # CurveZMQ keys (ipykernel 7) warns on every start that its traffic is plain text
        runtime = jupyter_runtime_dir()
        os.makedirs(runtime, mode=0o700, exist_ok=True)
        self.manager = KernelManager(kernel_name=kernel_name, transport="ipc",
                                     ip=os.path.join(runtime, f"kernel-{uuid.uuid4()}"))
        options: dict = {"cwd": cwd} if cwd else {}
        if env is not None:
            options["env"] = {**os.environ, **env}
        self.manager.start_kernel(**options)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        self._last_status = "ok"
        if load_ext:
            ran = self.execute("%load_ext taas_magic")
            assert ran.reply["status"] == "ok", ran.error_text()

    @property
    def pid(self) -> int:
        return self.manager.provisioner.pid  # type: ignore[union-attr]

    def children(self) -> list[psutil.Process]:
        """The kernel's descendants started for cells: not the warm spares, their factory or their
        watchdogs, which are kept on purpose (``--spare`` in the command line, and not yet
        renamed ``taas-rank`` by a cell that took them)."""
        kept = []
        for proc in self._descendants():
            try:
                parent = proc.parent()
                watchdog_of_spare = proc.name() == "taas-watchdog" and parent is not None and _kept_spare(parent)
                if not _kept_spare(proc) and not watchdog_of_spare:
                    kept.append(proc)
            except psutil.NoSuchProcess:
                pass
        return kept

    def spares(self) -> list[psutil.Process]:
        """Warm spare ranks waiting for the next cell (``taas_magic.rank --spare``: fresh, or forked by
        the spare factory; once a cell takes one it renames itself ``taas-rank`` and counts as the cell's)."""
        return [proc for proc in self._descendants()
                if _kept_spare(proc) and not self._factory(proc) and self._started_spares(proc)]

    def factories(self) -> list[psutil.Process]:
        """The spare factory (launch/local/sparefactory.py): it forks the spares and outlives them."""
        return [proc for proc in self._descendants() if _kept_spare(proc) and self._factory(proc)]

    def _factory(self, proc: psutil.Process) -> bool:
        """The spare factory: named so once it has started, and before that the kernel's child started
        with ``--factory`` (its forks keep that command line, but their parent is the factory)."""
        try:
            return _name(proc) == "taas-factory" or (proc.ppid() == self.pid and "--factory" in proc.cmdline())
        except psutil.NoSuchProcess:
            return False

    def _started_spares(self, proc: psutil.Process) -> bool:
        """Whether ``proc``'s parent starts spares: the kernel, or the factory (not a spare: that is its watchdog)."""
        try:
            return proc.ppid() == self.pid or self._factory(psutil.Process(proc.ppid()))
        except psutil.NoSuchProcess:
            return False

    def _descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def submit(self, code: str) -> tuple[str, float]:
        return self.client.execute(code), time.monotonic()

    def collect(self, msg_id: str, started: float, timeout: float = 120) -> Execution:
        messages: list[Message] = []
        deadline = time.monotonic() + timeout
        while True:
            msg = self._next_iopub(deadline)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "status" and msg["content"]["execution_state"] == "idle":
                idle_at = time.monotonic() - started  # the cell is over for the person
                break
            messages.append(Message(time.monotonic() - started, kind, msg["content"]))
        while True:
            reply = self.client.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        self._last_status = reply["content"]["status"]
        return Execution(reply["content"], idle_at, messages)

    def _next_iopub(self, deadline: float) -> dict:
        """The next iopub message; a kernel that died meanwhile fails the test at once, with its exit code
        (it would otherwise be waited on until the deadline: a crash in the kernel says nothing on iopub)."""
        while True:
            try:
                return self.client.get_iopub_msg(timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            except queue.Empty:
                if not self.manager.is_alive():
                    code = self.manager.provisioner.process.poll()  # type: ignore[union-attr]
                    raise AssertionError(f"the kernel died while a cell ran (exit code {code})") from None
                if time.monotonic() >= deadline:
                    raise

    def execute(self, code: str, timeout: float = 120) -> Execution:
        after_error = self._last_status == "error"
        msg_id, started = self.submit(code)
        ran = self.collect(msg_id, started, timeout)
        for _ in range(3):
            if not (ran.reply["status"] == "aborted" and after_error):
                break
            # ipykernel 6 aborts every execute_request that reaches it until one turn of its loop after an
            # error reply (stop_on_error: a notebook's "run all" stops at the failing cell); a client as fast
            # as this one can land in that window. The person's next cell is the one sent after it.
            msg_id, started = self.submit(code)
            ran = self.collect(msg_id, started, timeout)
        return ran

    def wait_for_stream(self, msg_id: str, needle: str | tuple[str, ...], timeout: float = 60) -> list[Message]:
        """Read iopub until rank output containing ``needle`` (every one of several) arrives."""
        needles = (needle,) if isinstance(needle, str) else needle
        text = []  # one printed line may arrive in two stream messages

        def arrived(kind: str, content: dict) -> bool:
            text.append(content.get("text", "") if kind == "stream" else "")
            return kind == "stream" and all(each in "".join(text) for each in needles)

        return self.wait_for(msg_id, arrived, repr(needle), timeout)

    def wait_for(self, msg_id: str, arrived: Callable[[str, dict], bool], what: str, timeout: float = 60) -> list[Message]:
        """Read iopub for the cell ``msg_id`` until ``arrived(msg_type, content)`` says so; what was read."""
        seen: list[Message] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            seen.append(Message(0.0, msg["msg_type"], msg["content"]))
            if arrived(msg["msg_type"], msg["content"]):
                return seen
        raise AssertionError(f"{what} never arrived; saw {seen}")

    def shutdown(self) -> None:
        self.client.stop_channels()
        if self.manager.is_alive():
            self.manager.shutdown_kernel(now=True)
        self.manager.cleanup_resources()


def away_layers_left(kernel: Kernel, timeout: float = 15) -> list[str]:
    """The layers of ``kernel``'s runs' away hosts (writes/away.py: their folders are named by its pid) still in this
    machine's temporary folder after ``timeout``. A cluster's agent removes its host's after its ranks ended, in a
    process that outlives them (a Slurm allocation's keeper, a Ray actor): gone a moment after the ranks, later on a
    loaded machine. Another kernel's away hosts (another test worker's) are not this one's."""
    import glob
    import tempfile

    pattern = os.path.join(tempfile.gettempdir(), f"taas-away-{kernel.pid}-*", "layer-*")
    deadline = time.monotonic() + timeout
    while (left := glob.glob(pattern)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def wait_until_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still running after ``timeout``. An orphaned zombie counts as gone: it has
    exited, and only waits for PID 1 (not ours) to read its status, which it does when it will
    (once more than 5 s late on a loaded machine). A zombie whose parent is alive still counts:
    that parent failed to reap it."""
    deadline = time.monotonic() + timeout
    while True:
        _, alive = psutil.wait_procs(processes, timeout=min(0.2, max(0.0, deadline - time.monotonic())))
        alive = [process for process in alive if not _exited(process)]
        if not alive or time.monotonic() >= deadline:
            return alive
        processes = alive


def _exited(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE and process.ppid() == 1
    except psutil.NoSuchProcess:
        return True


def wait_for_spares(kernel: Kernel, count: int, timeout: float = 120) -> bool:
    """Until ``count`` spares have imported torch and wait (their name says so): a fresh one imports torch in
    about 2 s on a quiet machine, several times that on a loaded one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ready = [p for p in kernel.spares() if p.name() == "taas-spare"]
        except psutil.NoSuchProcess:
            ready = []
        if len(ready) >= count:
            return True
        time.sleep(0.1)
    return False


def warm_up(kernel: Kernel) -> None:
    """Until the next 2-rank cell starts from warm spares (torch imported, its first step taken): a cell's end
    leaves them (``%taas warm auto``). For a test whose ranks must be somewhere within a short ``--timeout``,
    which counts from the launch: from warm spares that takes well under a second however loaded the machine;
    a cold start imports torch inside it (seconds; several times that on a loaded machine)."""
    assert kernel.execute("%taas warm auto").reply["status"] == "ok"
    ran = kernel.execute("#pragma taas --device cpu --gpus 2\npass")
    assert ran.reply["status"] == "ok", ran.error_text()
    assert wait_for_spares(kernel, 2), "no warm spares after a cell"


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def assert_nothing_left(kernel: Kernel) -> None:
    """No process started for a cell is still alive (waiting warm spares are kept on purpose): gone within a
    few seconds on a quiet machine; the rest of the 30 s is for a loaded one, where an ending process may wait
    seconds to be scheduled and reaped."""
    left = describe(left_after(kernel, timeout=30))
    assert not left, f"processes left behind: {left}"


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.NoSuchProcess:
        return ""


def _kept_spare(proc: psutil.Process) -> bool:
    """A spare that no cell has taken (warming or waiting), its factory, or a watchdog a spare just forked."""
    try:
        return "--spare" in proc.cmdline() and proc.name() != "taas-rank"
    except psutil.NoSuchProcess:
        return False


def left_after(kernel: "Kernel", timeout: float) -> list[psutil.Process]:
    """What the kernel started for cells and is still running after ``timeout``, looked at afresh
    each time (a spare forked while one look was taken is told apart by the next)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = wait_until_gone(kernel.children(), timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        if not alive or time.monotonic() >= deadline:
            return alive


def describe(processes: list[psutil.Process]) -> list[str]:
    """Each process with its name, state and parent (and the parent's), for a failing assertion."""
    lines = []
    for process in processes:
        try:
            parent = process.parent()
            whose = f"{parent.pid} {parent.name()} {parent.status()}" if parent is not None else "none"
            lines.append(f"{process.pid} {process.name()} {process.status()} parent {whose}: {' '.join(process.cmdline())}")
        except psutil.NoSuchProcess:
            pass
    return lines


@dataclass
class Session:
    prompts: list[str] = field(default_factory=list)  # each input_request's prompt, in order
    texts: list[str] = field(default_factory=list)  # the cell's stream text when each prompt came
    waits: list[float] = field(default_factory=list)  # seconds from each answer to the next prompt
    asked_at: list[float] = field(default_factory=list)  # time.time() of each prompt's arrival here
    text: str = ""  # all of the cell's stream text
    execution: Execution | None = None

    @property
    def error(self) -> dict | None:
        assert self.execution is not None
        return self.execution.error


Answer = Callable[[str, "Session"], "str | None"]  # (prompt, the session so far) -> a line, or None: interrupt


def debug(kernel: Kernel, code: str, answer: Answer | list[str], allow_stdin: bool = True,
          timeout: float = 120) -> Session:
    """Run ``code`` in the kernel; each prompt is answered by ``answer`` (a list: in order)."""
    if isinstance(answer, list):
        lines = iter(answer)
        answer = lambda prompt, session: next(lines)  # noqa: E731 - a list's answers, in turn
    session = Session()
    msg_id = kernel.client.execute(code, allow_stdin=allow_stdin)
    started = time.monotonic()
    answered_at: float | None = None
    messages: list[Message] = []
    idle = False
    while not idle:
        assert time.monotonic() - started < timeout, f"the cell did not end in {timeout} s: {session}"
        try:
            request = kernel.client.get_stdin_msg(timeout=0.01)
        except queue.Empty:
            request = None
        if request is not None:
            now = time.monotonic()
            session.asked_at.append(time.time())
            # what the cell printed before asking was sent on iopub first; another socket: give it 50 ms to be read
            _drain_iopub(kernel, msg_id, messages, session, quiet=0.05)
            if answered_at is not None:
                session.waits.append(now - answered_at)
            prompt = request["content"]["prompt"]
            session.prompts.append(prompt)
            session.texts.append(session.text)
            line = answer(prompt, session)
            if line is None:
                kernel.manager.interrupt_kernel()
            else:
                kernel.client.input(line)
            answered_at = time.monotonic()
        idle = _drain_iopub(kernel, msg_id, messages, session)
    while True:
        reply = kernel.client.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    session.execution = Execution(reply["content"], time.monotonic() - started, messages)
    kernel._last_status = reply["content"]["status"]
    return session


def _drain_iopub(kernel: Kernel, msg_id: str, messages: list[Message], session: Session, quiet: float = 0.01) -> bool:
    """Read iopub until it has been ``quiet`` that long; True once the cell is over (idle)."""
    while True:
        try:
            msg = kernel.client.get_iopub_msg(timeout=quiet)
        except queue.Empty:
            return False
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status" and content["execution_state"] == "idle":
            return True
        messages.append(Message(0.0, kind, content))
        if kind == "stream":
            session.text += content["text"]
