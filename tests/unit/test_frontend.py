"""How the kernel half of the live view knows whether ipykernel answers the page while a cell runs
(ipykernel >= 7.4: output/frontend.py), and the one line a cell says where it does not."""

import sys
from types import SimpleNamespace

import ipykernel
from ipykernel.ipkernel import IPythonKernel
from packaging.version import Version

from taas_magic.output import frontend
from taas_magic.output.frontend import MID_CELL_IPYKERNEL, answer_kernel_info_while_busy, answers_mid_cell, mid_cell_note


class _Kernel74:
    def dispatch_shell(self, msg, /, subshell_id=None, *, concurrent=False):
        pass


class _Kernel70:
    """ipykernel 7.0 to 7.3: every hook answer_kernel_info_while_busy looks for, but no ``concurrent``."""

    _shell_parent_ident = None
    io_loop = None

    def __init__(self):
        self.shell_channel_thread = SimpleNamespace(manager=SimpleNamespace(set_on_recv_callback=lambda callback: None))

    async def shell_main(self, subshell_id, msg):
        pass

    def dispatch_shell(self, msg, /, subshell_id=None):
        pass

    def set_parent(self, ident, parent, channel="shell"):
        pass

    def get_parent(self, channel=None):
        return {}

    def _get_shell_context_var(self, var):
        return None

    def _publish_status(self, status, channel, parent=None):
        pass


def test_the_probe_reads_the_capability_not_a_version():
    assert answers_mid_cell(_Kernel74())
    assert not answers_mid_cell(_Kernel70())
    assert not answers_mid_cell(object())
    assert not answers_mid_cell(SimpleNamespace(dispatch_shell=len))  # a builtin without a signature: assume not


def test_the_installed_ipykernel_answers_mid_cell_from_7_4_on():
    assert answers_mid_cell(IPythonKernel) == (Version(ipykernel.__version__) >= Version(MID_CELL_IPYKERNEL))


def test_an_older_kernel_gets_one_line_naming_its_release_and_the_one_that_answers():
    note = mid_cell_note(SimpleNamespace(kernel=_Kernel70()))
    assert note is not None and "\n" not in note
    assert note.startswith(f"taas: ipykernel {ipykernel.__version__} answers the page only between cells")
    assert f"ipykernel >= {MID_CELL_IPYKERNEL}" in note
    assert mid_cell_note(SimpleNamespace(kernel=_Kernel74())) is None
    assert mid_cell_note(SimpleNamespace()) is None  # a plain IPython shell: no page to answer


def test_kernel_info_is_not_hooked_where_dispatch_shell_cannot_run_it_concurrently():
    kernel = _Kernel70()
    original = kernel.shell_main
    assert not answer_kernel_info_while_busy(kernel)  # 7.0 to 7.3: dispatch_shell(concurrent=True) would raise
    assert kernel.shell_main == original


def test_the_note_names_a_release_even_without_ipykernel_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "ipykernel", None)
    note = frontend.mid_cell_note(SimpleNamespace(kernel=_Kernel70()))
    assert note is not None and note.startswith(f"taas: ipykernel before {MID_CELL_IPYKERNEL} answers")
