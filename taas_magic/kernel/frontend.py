"""What the kernel knows of the front ends showing it: can they restore widgets, and which cell is which.

A run's live view is a widget (output/widget.py) only where the page has ipywidgets' manager
and anywidget: there a reload brings the view back. Anywhere else (a terminal, nbclient,
a front end without widgets, the tests' own client) the run is shown as it always was, as the
cell's stream output. The kernel cannot ask the page what it renders, so it looks for
evidence, and assumes none until it has some (:class:`Frontend`):

- a page's widget manager opens the ``jupyter.widget.control`` comm when it connects to the
  kernel (on load and on every reload) to restore the widgets: the extension listens on that
  target from the moment it loads, then hands the comm to ipywidgets;
- when the extension loads it sends a probe, a tiny anywidget model whose module answers
  ``hello`` the moment a page creates it. The answer is noticed on ipykernel's shell channel
  thread (ipykernel 7.4 asks a comm there which subshell its message goes to), so it counts
  even while the main thread runs cells queued before it ("Run All").

A run that starts less than ``PROBE_WAIT_SECONDS`` after an unanswered probe waits for the
rest of that time before it chooses (it has launched already; only its view waits).
``TaasMagics.view`` overrides all of it: ``widget`` or ``stream``.

:func:`cell_publisher` is what a detached run's text view publishes with: display messages
addressed to the cell that started the run (its parent header captured then), whichever cell
runs when they are sent.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from typing import Any

from taas_magic.output.relay import Publish, publisher
from taas_magic.protocol import ClearOutput, Display

CONTROL_TARGET = "jupyter.widget.control"
PROBE_WAIT_SECONDS = 0.5
_PROBE_MODULE = "export default { initialize({ model }) { model.send({ hello: 1 }); } };"


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

    @property
    def restores_widgets(self) -> bool:
        return self._seen.is_set()

    def choose(self, setting: str) -> bool:
        """True: show a run as the live widget; False: as the cell's stream (``setting``: TaasMagics.view)."""
        if setting != "auto":
            return setting == "widget" and widgets_installed()
        if self._comms is None:
            return False
        if not self._seen.is_set() and self._probed_at is not None:
            self._seen.wait(max(0.0, PROBE_WAIT_SECONDS - (time.monotonic() - self._probed_at)))
        return self._seen.is_set()

    # -- evidence ---------------------------------------------------------------------------------
    def _control_opened(self, comm: Any, message: dict) -> None:
        self._heard()
        from ipywidgets import Widget  # registers its own targets; ours stays for the next page

        assert self._comms is not None
        self._comms.register_target(CONTROL_TARGET, self._control_opened)
        Widget.handle_control_comm_opened(comm, message)

    def _send_probe(self) -> None:
        import anywidget

        class _Probe(anywidget.AnyWidget):
            _esm = _PROBE_MODULE

        try:
            probe = _Probe()
        except Exception:  # noqa: BLE001 - no kernel to talk to (a plain IPython shell): no widgets either
            return
        assert self._comms is not None
        self._comms.register_target(CONTROL_TARGET, self._control_opened)  # importing ipywidgets took it over
        probe.on_msg(lambda *_: self._heard())
        comm = getattr(probe, "comm", None)
        if comm is not None and hasattr(comm, "_reply_subshell_for"):  # ipykernel >= 7.4: heard on its shell thread
            route = comm._reply_subshell_for

            def heard_on_the_shell_thread(data: object, default: object) -> object:
                self._heard()
                return route(data, default)

            comm._reply_subshell_for = heard_on_the_shell_thread
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
    display_pub = shell.display_pub
    session = getattr(display_pub, "session", None)
    if session is None:  # not a kernel: IPython's own publisher
        return publisher(display_pub)
    parent = dict(display_pub.parent_header)
    from ipykernel.jsonutil import json_clean

    def publish(message: Display | ClearOutput) -> None:
        content: dict[str, Any]
        if isinstance(message, ClearOutput):
            kind, content = "clear_output", {"wait": message.wait}
        else:
            kind = "update_display_data" if message.update else "display_data"
            content = {"data": message.data, "metadata": message.metadata, "transient": message.transient}
        sent = session.msg(kind, json_clean(content), parent=parent)
        session.send(display_pub.pub_socket, sent, ident=display_pub.topic)

    return publish
