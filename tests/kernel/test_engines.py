"""A fourth engine is one folder and one line (launch/engines.py): a copy of the package with a toy engine added
that way, in a real kernel, is attached by ``%taas cluster toy``, named by ``%taas help``, and runs a cell.

The toy engine is the local engine under another name: one node (this host), whose runs are local processes.
Nothing outside its folder and its line in ``CLUSTER_WORDS`` knows it: that is what the test shows.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

import taas_magic
from tests.kernel_client import Kernel

TOY = textwrap.dedent('''\
    """The toy engine: this host under another name."""

    from taas_magic.launch import engines
    from taas_magic.launch.placement import Node


    class ToyCluster:
        def __init__(self, options):
            self.options, self.attached = options, True

        def nodes(self):
            return [Node("toy-node", "127.0.0.1", 2, 2, 2.0, 2.0, is_notebook_host=True)]

        def place(self, gpus, per_host, wait):
            return engines.local_backend(gpus, None, None)

        def status_lines(self):
            return [f"cluster: toy ({self.options or 'no options'}), 1 node"]

        def detach(self):
            self.attached = False


    def attach(options, show):
        return ToyCluster(options)
''')
LINE = ('    "toy": Engine(lambda options, show: __import__("taas_magic.launch.toy", fromlist=["attach"]).attach(options, '
        'show), "OPTIONS", "a toy engine: this host under another name"),\n')


@pytest.fixture(scope="module")
def toy_kernel(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy-engine")
    package = root / "taas_magic"
    shutil.copytree(Path(taas_magic.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(Path(taas_magic.__file__).parent.parent / "taas.py", root / "taas.py")
    (package / "launch" / "toy").mkdir()
    (package / "launch" / "toy" / "__init__.py").write_text(TOY)  # the folder
    engines = package / "launch" / "engines.py"
    text = engines.read_text()
    anchor = "CLUSTER_WORDS: dict[str, Engine] = {\n"
    assert anchor in text
    engines.write_text(text.replace(anchor, anchor + LINE))  # the line
    kernel = Kernel(env={"PYTHONPATH": str(root)})
    yield kernel, package
    kernel.shutdown()


def test_a_toy_engine_added_as_one_folder_and_one_line_attaches_and_runs_a_cell(toy_kernel):
    kernel, package = toy_kernel
    where = kernel.execute("import taas_magic; print(taas_magic.__file__)").stream("stdout")
    assert where.strip() == str(package / "__init__.py"), where  # the copy, not the installed package
    shown = kernel.execute("%taas help").stream("stdout")
    assert "%taas cluster toy [OPTIONS]" in shown and "a toy engine: this host under another name" in shown, shown
    attached = kernel.execute("%taas cluster toy fast please")
    assert attached.reply["status"] == "ok", attached.error_text()
    assert "cluster: toy (fast please), 1 node" in attached.stream("stdout"), attached.stream()
    ran = kernel.execute("#pragma taas --gpus 2\nimport torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                         "t = torch.tensor([dist.get_rank() + 1.0])\ndist.all_reduce(t)\ntotal = t.item()\n", timeout=180)
    assert ran.reply["status"] == "ok", ran.error_text() + ran.stream()
    assert kernel.execute("print(total)").stream("stdout").strip() == "3.0"
    off = kernel.execute("%taas cluster off")
    assert off.reply["status"] == "ok" and "local mode" in off.stream("stdout"), off.stream()
