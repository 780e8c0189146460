"""import_hooks.py: a callback right after a module's first import, and a first import on a stack of its own.

Real modules, written under ``tmp_path`` with names of their own and put on ``sys.path``, are imported
by this process for real; each test forgets them afterwards. What the callbacks see is the module as its
code left it; what the import on its own stack keeps is checked through the frames the module itself
kept while it was imported, as Optuna's ``try_import`` keeps them.
"""

from __future__ import annotations

import importlib
import importlib.resources
import sys
import threading
import uuid

import pytest

from taas_magic import import_hooks
from taas_magic.import_hooks import import_on_own_stack, when_imported

pytestmark = pytest.mark.unpinned  # pure Python: nothing of the minimums' pins (.ci/run)


@pytest.fixture()
def modules(tmp_path, monkeypatch):
    """Write modules (name -> source; ``pkg/__init__`` for a package) and forget them after the test."""
    made: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(files: dict[str, str]) -> None:
        for name, source in files.items():
            path = tmp_path / f"{name}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(source)
            made.append(name.replace("/__init__", "").replace("/", "."))
        importlib.invalidate_caches()

    yield write
    for name in made:
        sys.modules.pop(name, None)
        import_hooks._finder.callbacks.pop(name, None)


def _name() -> str:
    return f"taas_test_{uuid.uuid4().hex[:12]}"


def test_a_callback_runs_once_right_after_the_first_import_with_the_module_as_its_code_left_it(modules):
    name = _name()
    modules({name: "VALUE = 41\nVALUE += 1\n"})
    seen = []
    when_imported(name, lambda module: seen.append((module.__name__, module.VALUE, name in sys.modules)))
    assert seen == []  # not imported yet: nothing runs
    module = importlib.import_module(name)
    assert seen == [(name, 42, True)]
    importlib.import_module(name)
    importlib.reload(module)
    assert seen == [(name, 42, True)]  # once: a second import, or a reload, is no first import


def test_a_module_already_imported_gets_its_callback_at_once(modules):
    name = _name()
    modules({name: "X = 'here'\n"})
    module = importlib.import_module(name)
    seen = []
    when_imported(name, seen.append)
    assert seen == [module]


def test_two_callbacks_for_one_module_both_run_in_the_order_given(modules):
    name = _name()
    modules({name: ""})
    order = []
    when_imported(name, lambda module: order.append("first"))
    when_imported(name, lambda module: order.append("then"))
    importlib.import_module(name)
    assert order == ["first", "then"]


def test_a_callback_can_change_the_module_before_anyone_uses_it(modules):
    """As the write rule patches torch.save, and nccl becomes gloo on a host without GPUs."""
    name = _name()
    modules({name: "def backend():\n    return 'nccl'\n"})
    when_imported(name, lambda module: setattr(module, "backend", lambda: "gloo"))
    module = importlib.import_module(name)
    assert module.backend() == "gloo"


def test_a_submodule_of_a_package_and_its_resources_work_as_without_the_hook(modules, tmp_path):
    package = _name()
    modules({f"{package}/__init__": "", f"{package}/inner": "LOADED = True\n"})
    (tmp_path / package / "data.txt").write_text("packaged")
    seen = []
    when_imported(package, lambda module: seen.append(module.__name__))
    when_imported(f"{package}.inner", lambda module: seen.append((module.__name__, module.LOADED)))
    inner = importlib.import_module(f"{package}.inner")
    assert seen == [package, (f"{package}.inner", True)]
    assert importlib.resources.files(package).joinpath("data.txt").read_text() == "packaged"
    assert sys.modules[package].__spec__.loader.is_package(package)  # the loader's own methods, through ours
    assert inner.__spec__.loader.get_source(f"{package}.inner") == "LOADED = True\n"


def test_a_module_that_fails_to_import_runs_no_callback_and_says_its_own_error(modules):
    name = _name()
    modules({name: "raise RuntimeError('broken module')\n"})
    seen = []
    when_imported(name, seen.append)
    with pytest.raises(RuntimeError, match="broken module"):
        importlib.import_module(name)
    assert seen == [] and name not in sys.modules


def test_a_name_that_does_not_exist_is_still_an_import_error(modules):
    name = _name()
    seen = []
    when_imported(name, seen.append)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)
    assert seen == []


KEEPS_ITS_FRAMES = """
import sys
frame, KEPT = sys._getframe(), []
while frame is not None:  # what a kept exception's traceback reaches through f_back
    KEPT.append(frame.f_code.co_name)
    frame = frame.f_back
THREAD = __import__("threading").current_thread().name
"""


def test_an_import_on_its_own_stack_keeps_none_of_the_callers_frames(modules):
    own, plain = _name(), _name()
    modules({own: KEEPS_ITS_FRAMES, plain: KEEPS_ITS_FRAMES})

    def the_cells_frame(name, importer):
        return importer(name)

    module = the_cells_frame(own, import_on_own_stack)
    assert "the_cells_frame" not in module.KEPT
    assert module.THREAD == f"taas-import-{own}"
    assert the_cells_frame(own, import_on_own_stack) is module  # imported already: returned as it is
    assert "the_cells_frame" in the_cells_frame(plain, importlib.import_module).KEPT  # what it avoids
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("taas-import-")]


def test_an_import_error_on_its_own_stack_is_raised_in_the_caller_without_the_threads_frames(modules):
    name = _name()
    modules({name: "import taas_no_such_dependency_anywhere\n"})
    with pytest.raises(ModuleNotFoundError, match="taas_no_such_dependency_anywhere") as raised:
        import_on_own_stack(name)
    frames = []
    traceback = raised.value.__traceback__
    while traceback is not None:
        frames.append(traceback.tb_frame.f_code.co_name)
        traceback = traceback.tb_next
    assert frames == ["test_an_import_error_on_its_own_stack_is_raised_in_the_caller_without_the_threads_frames",
                      "import_on_own_stack"]
