"""What the kernel knows of the front ends showing it: can they restore widgets, and which cell is which.

Runs in the kernel: on the cell's thread (the probe sent as the extension loads, the choice of a
view), in comm handlers (the widget manager's control comm; the probe's answer, heard on ipykernel's
shell channel thread), in ipykernel's main shell dispatch, which it wraps to answer ``kernel_info``
while a cell waits, and, for :func:`cell_publisher`, on whichever thread publishes.

A run's live view is a widget (output/widget.py) only where the page has ipywidgets' manager
and anywidget: there a reload brings the view back. Anywhere else (a terminal, nbclient,
a front end without widgets, the tests' own client) the run is shown as it always was, as the
cell's stream output. The kernel cannot ask the page what it renders, so it looks for
evidence, and assumes none until it has some (:class:`Frontend`):

- a page's widget manager opens the ``jupyter.widget.control`` comm when it connects to the
  kernel (on load and on every reload) to restore the widgets: the extension listens on that
  target from the moment it loads, then hands the comm to ipywidgets;
- when the extension loads it sends a probe, a tiny anywidget model (opened as a plain comm,
  without importing ipywidgets) whose module answers ``hello`` the moment a page creates
  it. The answer is noticed on ipykernel's shell channel thread (ipykernel 7.4 asks a comm
  there which subshell its message goes to), so it counts
  even while the main thread runs cells queued before it ("Run All").

A run that starts less than ``PROBE_WAIT_SECONDS`` after an unanswered probe, from a cell a
notebook page sent (its request names the cell), waits for the rest of that time before it
chooses (it has launched already; only its view waits).
``TaasMagics.view`` overrides all of it: ``widget`` or ``stream``.

A reloaded page first asks the kernel for its ``kernel_info`` and holds every other message
until it is answered or 3 s have passed (JupyterLab's ``DEFAULT_KERNEL_INFO_TIMEOUT``);
ipykernel answers comm messages while a coroutine cell waits, but a ``kernel_info_request``
waits for the cell. :func:`answer_kernel_info_while_busy` lets it through the same way
ipykernel lets comm messages through (dispatched at once, the running cell's parent header
kept), then says "idle" for it (the page's request is done only at its reply and its idle)
and "busy" again for the running cell, so a reloaded page gets its widgets back in well
under 2 s instead of 3. It wraps ipykernel 7's handler of the main shell's messages; on a
kernel without that hook it does nothing, and the page waits its 3 s.

Answering the page while a cell runs (a reloaded view's request for the entries it missed,
its ``kernel_info``) needs ipykernel >= 7.4 (:data:`MID_CELL_IPYKERNEL`), the first that
dispatches comm messages while a coroutine cell waits (its ``dispatch_shell`` takes
``concurrent``: :func:`answers_mid_cell`). An older kernel (the declared minimum is 6.19.1)
answers the page only between cells: the run is still its live widget, fed as it runs, but a
page reloaded while the cell runs gets it back only when the cell ends, and
:func:`mid_cell_note` is the one line the cell says so with.

:func:`cell_publisher` is what a detached run's text view publishes with: display messages
addressed to the cell that started the run (its parent header captured then), whichever cell
runs when they are sent. :func:`cell_output` is the same for a foreground cell's own stream view,
its text too: each message straight to the IOPub thread, none waiting on a flush.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import threading
import time
from typing import Any, Callable

from taas_magic.output.relay import ClearOutput, Display, Publish, TextOut, publisher

CONTROL_TARGET = "jupyter.widget.control"
# a page answers in a few hundred ms on a quiet machine; with the spare factory importing torch beside the
# kernel's and the browser's work on 2 cores (the extension starts it as it loads), a 0.3 s wait missed a
# page's answer once in 30 runs of the browser test. Only a run from a page's cell this soon after loading
# ever waits, and only its view does
PROBE_WAIT_SECONDS = 2.0
WIDGET_PROTOCOL = "2.1.0"  # ipywidgets' comm protocol, as its models are opened
MID_CELL_IPYKERNEL = "7.4"  # the first ipykernel that answers comm messages while a coroutine cell waits
_PROBE_MODULE = "export default { initialize({ model }) { model.send({ hello: 1 }); } };"


def _probe_state() -> dict[str, object]:
    """An anywidget model's state, as anywidget opens one, with the probe's module."""
    # private API: see taas_magic/private.py (anywidget's model state, built by hand)
    from importlib.metadata import version

    parts = version("anywidget").split(".", 2)
    semver = ".".join(parts) if any(tag in parts[-1] for tag in ("a", "b")) else f"~{parts[0]}.{parts[1]}.*"
    return {"_model_name": "AnyModel", "_model_module": "anywidget", "_model_module_version": semver,
            "_view_name": "AnyView", "_view_module": "anywidget", "_view_module_version": semver,
            "_esm": _PROBE_MODULE, "_anywidget_id": "taas_magic.output.frontend.probe", "_dom_classes": []}


def widgets_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("anywidget", "ipywidgets"))


class Frontend:
    """Whether a page that restores widgets shows this kernel (see the module docstring)."""

    def __init__(self, shell: Any):
        self.shell = shell
        self._seen = threading.Event()
        self._probe: Any = None
        self._probed_at: float | None = None
        self._comms = _comm_manager(shell) if widgets_installed() else None
        if self._comms is not None:
            self._comms.register_target(CONTROL_TARGET, self._control_opened)
            self._send_probe()
            answer_kernel_info_while_busy(shell.kernel)

    @property
    def restores_widgets(self) -> bool:
        return self._seen.is_set()

    def choose(self, setting: str) -> bool:
        """True: show a run as the live widget; False: as the cell's stream (``setting``: TaasMagics.view)."""
        if setting != "auto":
            return setting == "widget" and widgets_installed()
        if self._comms is None:
            return False
        if not self._seen.is_set() and self._probed_at is not None and self._from_a_notebook_page():
            self._seen.wait(max(0.0, PROBE_WAIT_SECONDS - (time.monotonic() - self._probed_at)))
        return self._seen.is_set()

    def _from_a_notebook_page(self) -> bool:
        """The running cell came from a notebook's page (its request names the cell: JupyterLab, Notebook 7
        and VS Code do; a plain client such as the tests' does not), so its widget answer is worth a wait."""
        parent = self.shell.kernel.get_parent() if getattr(self.shell, "kernel", None) is not None else {}
        return bool((parent or {}).get("metadata", {}).get("cellId"))

    # -- evidence ---------------------------------------------------------------------------------
    def _control_opened(self, comm: Any, message: dict) -> None:
        self._heard()
        from ipywidgets import Widget  # registers its own targets; ours stays for the next page

        assert self._comms is not None
        self._comms.register_target(CONTROL_TARGET, self._control_opened)
        Widget.handle_control_comm_opened(comm, message)  # private API: see taas_magic/private.py

    def _send_probe(self) -> None:
        """The probe model, opened as a plain comm: importing ipywidgets here (anywidget does) made the
        first cell after loading about 0.1 s slower to start, in every front end."""
        from comm import create_comm

        try:
            probe = create_comm(target_name="jupyter.widget", data={"state": _probe_state(), "buffer_paths": []},
                                metadata={"version": WIDGET_PROTOCOL})
        except Exception:  # noqa: BLE001 - no kernel to talk to (a plain IPython shell): no widgets either
            return
        probe.on_msg(lambda _message: self._heard())
        # private API: see taas_magic/private.py (ipykernel >= 7.4: the answer is heard on its shell thread)
        if hasattr(probe, "_reply_subshell_for"):
            route = probe._reply_subshell_for

            def heard_on_the_shell_thread(data: object, default: object) -> object:
                self._heard()
                return route(data, default)

            probe._reply_subshell_for = heard_on_the_shell_thread
        self._probe, self._probed_at = probe, time.monotonic()

    def _heard(self) -> None:
        self._seen.set()

    def close(self) -> None:
        if self._probe is not None:
            self._probe.close()
            self._probe = None


def _comm_manager(shell: Any) -> Any:
    """The kernel's comm manager, or None outside a kernel."""
    if getattr(shell, "kernel", None) is None:
        return None
    try:
        from comm import get_comm_manager

        return get_comm_manager()
    except Exception:  # noqa: BLE001 - no comm support in this shell: no widgets
        return None


def cell_publisher(shell: Any) -> Publish:
    """Display messages addressed to the cell running now, from any thread, even after it ended."""
    send = _cell_sender(shell.display_pub)
    if send is None:  # not a kernel: IPython's own publisher
        return publisher(shell.display_pub)
    return _display_sender(send, shell.display_pub.topic)


Send = Callable[[str, dict, bytes], None]  # a message's type, its content and its topic, sent to one cell


def _cell_sender(display_pub: Any) -> Send | None:
    """What sends a message addressed to the cell running now (its parent header captured now), from any thread,
    straight to ipykernel's IOPub queue; None where ``display_pub`` is not a kernel's."""
    session = getattr(display_pub, "session", None)
    if session is None:
        return None
    parent = dict(display_pub.parent_header)  # private API: see taas_magic/private.py (ZMQDisplayPublisher)

    def send(kind: str, content: dict, topic: bytes) -> None:
        session.send(display_pub.pub_socket, session.msg(kind, content, parent=parent), ident=topic)

    return send


def _display_sender(send: Send, topic: bytes) -> Publish:
    from ipykernel.jsonutil import json_clean

    def publish(message: Display | ClearOutput) -> None:
        content: dict[str, Any]
        if isinstance(message, ClearOutput):
            kind, content = "clear_output", {"wait": message.wait}
        else:
            kind = "update_display_data" if message.update else "display_data"
            content = {"data": message.data, "metadata": message.metadata, "transient": message.transient}
        send(kind, json_clean(content), topic)

    return publish


class _CellText:
    """One of the cell's text streams, each write sent at once as a ``stream`` message (see :func:`cell_output`)."""

    def __init__(self, name: str, send: Send):
        self.name, self._send, self._topic = name, send, f"stream.{name}".encode()

    def write(self, text: str, /) -> int:
        if text:
            self._send("stream", {"name": self.name, "text": text}, self._topic)
        return len(text)

    def flush(self) -> None:
        """Each write was sent already."""


def cell_output(shell: Any) -> tuple[dict[str, TextOut], Publish] | None:
    """The running cell's stdout, stderr and display publisher, each message sent the moment it is written,
    in order, addressed to this cell; None where the cell's output is not ipykernel's own (``%%capture``,
    ``capture_output``, a terminal): there the caller writes to ``sys.stdout`` and the shell's publisher.

    ipykernel's own ``sys.stdout.flush()`` from the main thread waits for its IOPub thread to send what was
    written, and its display publisher flushes both streams that way before each display: a run's first
    entries (its header, the live board's two displays, rank 0's first line) took four such round trips,
    about 3 ms of a kept cell's 12 (bench/keep.py). Here each message goes straight to the IOPub thread's
    queue, as ipykernel's own messages do, so they keep their order and nothing waits. The notebook's streams
    are not flushed first (that too waited): ipykernel flushed them as the last cell ended, and this cell has
    printed nothing of its own in the kernel; what another thread of the notebook prints meanwhile keeps its
    own order, as it would beside any cell's output."""
    from ipykernel.iostream import OutStream

    send = _cell_sender(shell.display_pub)
    if send is None or not all(isinstance(stream, OutStream) for stream in (sys.stdout, sys.stderr)):
        return None
    streams: dict[str, TextOut] = {name: _CellText(name, send) for name in ("stdout", "stderr")}
    return streams, _display_sender(send, shell.display_pub.topic)


def answers_mid_cell(kernel: Any) -> bool:
    """Whether ``kernel`` dispatches the page's comm messages while a coroutine cell waits (ipykernel >=
    :data:`MID_CELL_IPYKERNEL`), told by its ``dispatch_shell`` taking ``concurrent``, the parameter that
    release added for it: a capability, not a version number, so a kernel without it is never asked."""
    dispatch = getattr(kernel, "dispatch_shell", None)  # private API: see taas_magic/private.py
    try:
        return dispatch is not None and "concurrent" in inspect.signature(dispatch).parameters
    except (TypeError, ValueError):  # no signature to read: assume the oldest behaviour
        return False


def mid_cell_note(shell: Any) -> str | None:
    """The one line a cell shown as the live widget says where the kernel answers the page only between
    cells (see the module docstring); None where it answers mid-cell, or there is no kernel."""
    kernel = getattr(shell, "kernel", None)
    if kernel is None or answers_mid_cell(kernel):
        return None
    release = getattr(sys.modules.get("ipykernel"), "__version__", "before " + MID_CELL_IPYKERNEL)
    return (f"taas: ipykernel {release} answers the page only between cells: a page reloaded while this cell "
            f"runs shows its live view again when the cell ends (ipykernel >= {MID_CELL_IPYKERNEL} at once)")


def answer_kernel_info_while_busy(kernel: Any) -> bool:
    """Answer ``kernel_info_request`` at once while a cell holds the main shell (see the module
    docstring); False where this kernel has no such hook (the page then waits its timeout).

    The kernel's handler of main-shell messages is replaced on the kernel (so a kernel that
    starts after the extension loaded, as the taas kernel spec's does, registers ours) and,
    where the kernel has started already, registered again with its subshell manager. Every
    ipykernel name used here is private: see taas_magic/private.py."""
    if not answers_mid_cell(kernel):  # 7.0 to 7.3 have the hook but dispatch_shell(concurrent=) is 7.4's
        return False
    manager = getattr(getattr(kernel, "shell_channel_thread", None), "manager", None)
    needed = ("shell_main", "dispatch_shell", "set_parent", "get_parent", "_get_shell_context_var", "_shell_parent_ident",
              "_publish_status")
    if manager is None or not hasattr(manager, "set_on_recv_callback") or not all(hasattr(kernel, n) for n in needed):
        return False
    if getattr(kernel.shell_main, "taas", False):
        return True
    original = kernel.shell_main

    async def shell_main(subshell_id: str | None, message: list) -> None:
        lock = getattr(kernel, "_main_asyncio_lock", None)
        if subshell_id is None and lock is not None and lock.locked() and _message_type(kernel, message) == "kernel_info_request":
            parent = kernel.get_parent("shell")
            ident = kernel._get_shell_context_var(kernel._shell_parent_ident)
            try:
                await kernel.dispatch_shell(message, subshell_id=None, concurrent=True)
                # A front end's request is done at its reply and its "idle": then the cell's "busy" again.
                kernel._publish_status("idle", "shell")
            finally:
                kernel.set_parent(ident, parent, channel="shell")  # the running cell's, for its output
                kernel._publish_status("busy", "shell", parent)
            return
        await original(subshell_id, message)

    shell_main.taas = True  # type: ignore[attr-defined]  # how a second load knows
    kernel.shell_main = shell_main
    if getattr(kernel, "io_loop", None) is not None:  # started: its handler is registered already
        manager.set_on_recv_callback(shell_main)
    return True


def _message_type(kernel: Any, message: list) -> str | None:
    try:
        _, frames = kernel.session.feed_identities(message, copy=False)
        return kernel.session.deserialize(frames, content=False, copy=False)["header"].get("msg_type")
    except Exception:  # noqa: BLE001 - not ours to judge: the kernel's own handler reports a bad message
        return None
