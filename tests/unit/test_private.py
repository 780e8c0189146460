"""Every private API taas_magic calls (taas_magic/private.py) is still there, with the shape we use.

Each entry is imported and checked: it exists; it is callable with the parameters we pass; it
has the attributes we read (on the class, or assigned by the source that makes its instances);
its source still calls the hook of ours it calls. A failure names the API, the release
installed, the releases it was checked against, and what taas_magic uses it for. .ci/run runs
this on the newest releases and on the declared minimums (.ci/minimums.txt).

torch's CUDA IPC calls are checked on a CPU torch too: they must be torch's compiled bindings
(not the Python placeholders that raise NotImplementedError) and answer a call with CUDA's
absence; what they return needs a GPU (checked here where there is one, and in tests/gpu).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import linecache
import pickle
import platform
import re
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from taas_magic.private import PRIVATE, Private

ROOT = Path(__file__).resolve().parents[2]
MISSING = object()
OUR_OWN = {"self", "cls", "os"}  # names whose underscored attributes are ours (or public: os._exit)
PUBLIC_UNDERSCORED = {"_fields"}  # documented public API of the standard library (a named tuple's field names)


def _installed(api: Private) -> str:
    if api.package == "python":
        return platform.python_version()
    try:
        return version(api.package)
    except PackageNotFoundError:
        pytest.skip(f"{api.package} is not installed (an extra)")


def _fail(api: Private, what: str) -> None:
    pytest.fail(f"private API {api.name} ({api.package} {_installed(api)} installed; checked against {api.checked}) "
                f"{what}. taas_magic uses it in {api.where}: {api.use}", pytrace=False)


def _resolve(api: Private) -> tuple[Any, str, Any]:
    """(what holds the last part, the last part, the object itself or MISSING): the longest module
    prefix of the name imported, then the rest as attributes."""
    parts = api.name.split(".")
    for end in range(len(parts), 0, -1):
        module = ".".join(parts[:end])
        try:
            with warnings.catch_warnings():  # what the package says of itself as it imports is not our API's shape
                warnings.simplefilter("ignore", DeprecationWarning)
                found: Any = importlib.import_module(module)
            break
        except ModuleNotFoundError as error:
            if error.name is None or not module.startswith(error.name):
                raise  # the module is there but cannot be imported: that is the failure to show
    holder: Any = None
    for index in range(end, len(parts)):
        holder = found
        found = getattr(holder, parts[index], MISSING)
        if found is MISSING and index < len(parts) - 1:
            _fail(api, f"is gone: {'.'.join(parts[:index + 1])} does not exist")
    return holder, parts[-1], found


def _sources(cls: type, modules: tuple[str, ...] = ()) -> str:
    """The source of ``cls`` and its bases, and of ``modules``: where instance attributes are set."""
    texts = []
    for each in [*cls.__mro__, *(importlib.import_module(name) for name in modules)]:
        try:
            texts.append(inspect.getsource(each))
        except (OSError, TypeError):  # compiled, or object itself
            pass
    return "\n".join(texts)


def _has(holder: Any, name: str, modules: tuple[str, ...] = ()) -> bool:
    """``holder`` has ``name``: as an attribute, or (a class) set on its instances by its source."""
    if hasattr(holder, name):
        return True
    if not inspect.isclass(holder):
        return False
    assigned = re.compile(rf"\.{re.escape(name)}\s*(:[^=\n]*)?=(?!=)|[\"']{re.escape(name)}[\"']")
    return bool(assigned.search(_sources(holder, modules)))


def _accepts(signature: inspect.Signature, name: str) -> bool:
    return name in signature.parameters or any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())


@pytest.mark.parametrize("api", PRIVATE, ids=lambda api: api.name)
def test_each_private_api_is_there_with_the_shape_we_use(api: Private):
    installed = _installed(api)
    if api.since and Version(installed) < Version(api.since):
        pytest.skip(f"{api.package} {installed} predates {api.since}: taas_magic does without {api.name}")
    holder, last, found = _resolve(api)
    if found is MISSING and not _has(holder, last, api.set_in):
        _fail(api, "is gone")
    if api.by_path and (not inspect.isclass(found) or found.__module__ != api.name.rsplit(".", 1)[0]):
        _fail(api, f"is no longer a class defined in {api.name.rsplit('.', 1)[0]} (we recognise it by that path)")
    if api.params:
        if not callable(found):
            _fail(api, "is no longer callable")
        signature = inspect.signature(found)
        missing = [name for name in api.params if not _accepts(signature, name)]
        if missing:
            _fail(api, f"no longer takes {', '.join(missing)}: its signature is {signature}")
    gone = [name for name in api.attributes if not _has(found, name, api.set_in)]
    if gone:
        _fail(api, f"no longer has {', '.join(gone)}")
    if api.mentions:
        source = inspect.getsource(found)
        unused = [name for name in api.mentions if name not in source]
        if unused:
            _fail(api, f"no longer calls {', '.join(unused)}")


def test_every_entry_names_modules_that_use_it():
    stale = []
    for api in PRIVATE:
        tokens = {api.name.rsplit(".", 1)[-1], *api.attributes, *api.mentions}
        if api.name.startswith("anywidget._util."):
            tokens.add(getattr(importlib.import_module("anywidget._util"), tokens.pop()))  # a key: its value is used
        for where in api.where.split(", "):
            path = ROOT / where if where == "taas.py" else ROOT / "taas_magic" / where
            if not path.exists() or not any(token in path.read_text() for token in tokens):
                stale.append(f"{api.name}: {where}")
    assert not stale, f"taas_magic/private.py names modules that do not use the API: {stale}"


def _sources_of_the_package() -> list[tuple[Path, ast.Module]]:
    return [(path, ast.parse(path.read_text())) for path in [ROOT / "taas.py", *sorted((ROOT / "taas_magic").rglob("*.py"))]]


def _our_own_names(trees: list[tuple[Path, ast.Module]]) -> set[str]:
    """Underscored names the package defines itself: functions, classes, module names, ``self._x``."""
    own = set()
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                  and node.value.id in ("self", "cls")):
                own.add(node.attr)
    return own


def _underscored_uses() -> dict[str, list[str]]:
    """Every ``x._name``, ``getattr(x, "_name")`` and ``from a._b import`` in the package whose name
    the package does not define itself (those are ours: a run's ``_thread``, taas's ``_IN_RANK``)."""
    found: dict[str, list[str]] = {}
    trees = _sources_of_the_package()
    own = _our_own_names(trees)
    for path, tree in trees:
        foreign = {(alias.asname or alias.name).split(".")[0] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                   and not (getattr(node, "module", None) or node.names[0].name).startswith("taas") for alias in node.names}
        for node in ast.walk(tree):
            names: list[str] = []
            base = node.value if isinstance(node, ast.Attribute) else node.args[0] if isinstance(node, ast.Call) and node.args else None
            of_a_package = isinstance(base, ast.Name) and base.id in foreign  # pickle._Unpickler is not our _Unpickler
            if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id in OUR_OWN):
                names = [node.attr]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
                names = [arg.value for arg in node.args[1:2] if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.module.startswith(("taas", "__future__")):
                names = [*node.module.split("."), *(alias.name for alias in node.names)]
            for name in names:
                if name.startswith("_") and not name.startswith("__") and (name not in own or of_a_package
                                                                            or isinstance(node, ast.ImportFrom)):
                    found.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_underscored_name_the_code_uses_is_in_the_table():
    listed = {part for api in PRIVATE for part in (*api.name.split("."), *api.attributes, *api.mentions)}
    unlisted = {name: where for name, where in _underscored_uses().items() if name not in listed | PUBLIC_UNDERSCORED}
    assert not unlisted, f"private APIs used but not listed in taas_magic/private.py: {unlisted}"


# -- what a shape check cannot see -------------------------------------------------------------------

def test_torch_cuda_ipc_calls_are_torchs_compiled_bindings():
    torch = pytest.importorskip("torch")
    for name in ("_share_cuda_", "_new_shared_cuda", "_release_ipc_counter_cuda"):
        definer = next((cls for cls in torch.UntypedStorage.__mro__ if name in vars(cls)), None)
        assert definer is not None, f"private API torch.UntypedStorage.{name} is gone (transfer/cudaipc.py)"
        assert definer.__module__ == "torch._C", (
            f"private API torch.UntypedStorage.{name} now resolves to {definer.__module__}.{definer.__qualname__}, "
            "not torch's compiled binding (transfer/cudaipc.py)")
    if torch.cuda.is_available():
        storage = torch.ones(4, device="cuda").untyped_storage()
        handle = storage._share_cuda_()
        assert isinstance(handle, tuple) and len(handle) == 8, (
            f"private API torch.UntypedStorage._share_cuda_ returned {type(handle).__name__} of {len(handle)}, "
            "not the 8-item handle transfer/cudaipc.py reads")
        return
    calls = {"_share_cuda_": lambda: torch.UntypedStorage(4)._share_cuda_(),
             "_new_shared_cuda": lambda: torch.UntypedStorage._new_shared_cuda(0, b"", 4, 0, b"/x", 0, b"", False),
             "_release_ipc_counter_cuda": lambda: torch.UntypedStorage._release_ipc_counter_cuda(b"/x", 0)}
    for name, call in calls.items():
        with pytest.raises(RuntimeError) as raised:
            call()
        assert type(raised.value) is not NotImplementedError and "CUDA" in str(raised.value), (
            f"private API torch.UntypedStorage.{name} on a torch without CUDA: {raised.value!r}")


def test_linecache_keeps_entries_registered_as_ipython_does(tmp_path):
    filename = "<taas In[7]>"
    lines = ["x = 1\n", "raise ValueError(x)\n"]
    linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)  # as rank/execute.py does
    try:
        linecache.checkcache(filename)  # what traceback does before reading: an mtime of None keeps the entry
        assert linecache.getline(filename, 2) == lines[1], "linecache no longer keeps entries without an mtime"
    finally:
        linecache.cache.pop(filename, None)
    real = tmp_path / "cell.py"
    real.write_text("".join(lines))
    assert linecache.getline(str(real), 1) == lines[0]
    entry = linecache.cache[str(real)]
    assert len(entry) == 4 and entry[2] == lines, f"linecache's entries are no longer (size, mtime, lines, name): {entry!r}"


def test_the_pure_python_unpicklers_get_opcodes_are_the_methods_unpack_wraps():
    for opcode, method in ((pickle.GET, "load_get"), (pickle.BINGET, "load_binget"), (pickle.LONG_BINGET, "load_long_binget")):
        assert pickle._Unpickler.dispatch[opcode[0]] is getattr(pickle._Unpickler, method), (
            f"private API pickle._Unpickler.dispatch no longer maps {opcode!r} to {method} (transfer/unpack.py)")


def test_the_probe_opens_the_model_anywidget_itself_would():
    pytest.importorskip("anywidget")
    from anywidget import AnyWidget
    from anywidget._util import _ANYWIDGET_ID_KEY, _ESM_KEY

    from taas_magic.output.frontend import _probe_state

    state = _probe_state()
    assert _ANYWIDGET_ID_KEY in state and _ESM_KEY in state, (_ANYWIDGET_ID_KEY, _ESM_KEY, sorted(state))
    traits = AnyWidget.class_traits()
    for name in ("_model_name", "_model_module", "_view_name", "_view_module"):
        assert state[name] == traits[name].default_value, (name, state[name], traits[name].default_value)
    for name in ("_model_module_version", "_view_module_version"):
        ours, theirs = (re.findall(r"\d+", str(value))[:2] for value in (state[name], traits[name].default_value))
        assert ours == theirs, f"the probe's {name} {state[name]!r} does not admit anywidget's {traits[name].default_value!r}"
