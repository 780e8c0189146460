"""The folder layout shows the data flow: imports run one way, and shared helpers live in one place."""

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "taas_magic"


@functools.cache
def _modules() -> dict[str, ast.Module]:
    """Every module of the package, parsed once for the whole file (read-only: the tests only walk them)."""
    return {str(path.relative_to(PACKAGE.parent)): ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imported(path: str, tree: ast.Module) -> set[str]:
    """The taas_magic modules a module imports: ``from taas_magic import wire`` names ``taas_magic.wire``."""
    package = path.removesuffix(".py").replace("/", ".").rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}") else base for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("taas_magic")}


# The stages a cell flows through, in order; then the features that have a kernel half and a
# rank half; under them all, the ground of contracts (the modules at the top of the package).
# A cell reaches its ranks through one of two faces: the kernel (the cell run now, in the notebook)
# or export (the cell written as a job that runs later without Jupyter: ``%taas export``, then
# ``python SCRIPT``, torchrun, sbatch or Ray); both read the cell stage, and start ranks below them.
STAGES = ["cell", "kernel", "export", "launch", "feed", "rank"]
FACES = {"kernel", "export"}
FEATURES = ["transfer", "output", "autopsy", "writes", "search", "compilecache", "profiling", "debugger"]
# The ground holds at most 10 modules, and __init__.py (the entry point): 11 files at the top of
# taas_magic/. checkpoints.py went to writes/ (what the ranks write to the repository) to make room
# for history.py (the bounded series the output and the search both keep) and private.py (the
# table of private APIs).
GROUND_MOST = 11  # modules at the top level of taas_magic/, __init__.py included
# The kernel's rooms, from the IPython face down: the face (the magic and the line commands) starts
# searches and runs; a search is many runs; a run is supervised. Each imports only the rooms below it.
KERNEL_ROOMS = ["magic", "trials", "runs", "supervision"]
ROOM_MOST = 10  # modules in one room of the kernel, __init__.py not counted
LINES_MOST = 400  # lines in any module of the package or of bench/
BENCH = PACKAGE.parent / "bench"


def _room(module: str) -> str:
    """``cell``, ``kernel.runs``, ..., ``transfer``, ...; ``ground`` for a top-level module."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "kernel" and parts[2] in KERNEL_ROOMS:
        return f"kernel.{parts[2]}"
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else "ground"


def _may_import(room: str) -> set[str]:
    """A stage imports later stages and the features (a face, the kernel or export, also reads the
    cell stage); a feature imports only the ground; the ground imports only itself. A room of the kernel imports
    the kernel's rooms below it, and what the kernel may."""
    if room.startswith("kernel."):
        below = KERNEL_ROOMS[KERNEL_ROOMS.index(room.split(".")[1]) + 1:]
        return {f"kernel.{name}" for name in below} | _may_import("kernel")
    if room in STAGES:
        later = set(STAGES[STAGES.index(room) + 1:]) | set(FEATURES) | {"ground"}
        return later | ({"cell"} if room in FACES else set())
    return {"ground"}


def _module_name(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def test_the_rooms_are_the_stages_the_features_and_the_ground():
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and (path / "__init__.py").exists()}
    assert folders == set(STAGES) | set(FEATURES), folders
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= GROUND_MOST, top


def test_the_kernel_is_four_rooms_of_at_most_ten_modules():
    kernel = PACKAGE / "kernel"
    assert sorted(path.name for path in kernel.glob("*.py")) == ["__init__.py"]  # nothing flat beside the rooms
    assert sorted(path.name for path in kernel.iterdir() if (path / "__init__.py").exists()) == sorted(KERNEL_ROOMS)
    for room in KERNEL_ROOMS:
        modules = [path.name for path in (kernel / room).glob("*.py") if path.name != "__init__.py"]
        assert 0 < len(modules) <= ROOM_MOST, (room, modules)


def _every_module() -> list[Path]:
    """Every module of the package and of bench/ (what a reader opens by its file name)."""
    return sorted(PACKAGE.rglob("*.py")) + sorted(BENCH.rglob("*.py"))


def test_no_module_is_longer_than_four_hundred_lines():
    long = {str(path.relative_to(PACKAGE.parent)): lines for path in _every_module()
            if (lines := len(path.read_text().splitlines())) > LINES_MOST}
    assert not long, long


def test_imports_run_down_the_floors():
    upward = []
    for path, tree in _modules().items():
        if path == "taas_magic/__init__.py":
            continue  # the extension's entry point: it loads the magic (kernel) and the input transformer (cell)
        room = _room(_module_name(path))
        for name in _imported(path, tree):
            target = _room(name)
            if name != "taas_magic" and target != room and target not in _may_import(room):
                upward.append(f"{path} ({room}) imports {name} ({target})")
    assert not upward, upward


def test_no_module_imports_itself_through_others():
    modules = {_module_name(path): tree for path, tree in _modules().items()}
    edges = {name: {target for target in _imported(name.replace(".", "/") + ".py", tree) if target in modules} - {name}
             for name, tree in modules.items()}
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        assert name not in path, "import cycle: " + " -> ".join(path[path.index(name):] + [name])
        if name in done:
            return
        for target in edges[name]:
            visit(target, path + [name])
        done.add(name)

    for name in modules:
        visit(name, [])


def test_temp_dir_helpers_and_prctl_are_written_once():
    helpers = {"remove_tree", "sweep_orphans", "ram_root", "spill_root", "memory_dir"}
    for path, tree in _modules().items():
        defined = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        if path != "taas_magic/tempdirs.py":
            assert not defined & helpers, (path, defined & helpers)
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "prctl"]
        if path != "taas_magic/rank/lifeline.py":
            assert not calls, f"{path} calls prctl itself: use lifeline.prctl"


def test_ranks_and_data_workers_start_through_one_module():
    for path in ("taas_magic/rank/main.py", "taas_magic/feed/worker.py"):
        tree = _modules()[path]
        assert "taas_magic.rank.startup" in _imported(path, tree), path
        source = (PACKAGE.parent / path).read_text()
        for step in ("start_watchdog", "read_first_line", "BlockingChannel.connect", "os._exit"):
            assert step not in source, f"{path} does {step} itself: rank/startup.py does it"


def test_no_function_is_longer_than_sixty_lines():
    long = []
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


def _parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Positional, keyword-only, ``*args`` and ``**kwargs``; a method's ``self`` or ``cls`` is not counted."""
    args = node.args
    positional = [arg.arg for arg in args.posonlyargs + args.args]
    count = len(positional) + len(args.kwonlyargs) + (args.vararg is not None) + (args.kwarg is not None)
    return count - (positional[:1] in (["self"], ["cls"]))


def test_no_parameter_list_is_longer_than_six():
    wide = []
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameter_count(node) > 6:
                wide.append(f"{path}:{node.lineno} {node.name} ({_parameter_count(node)} parameters)")
    assert not wide, wide


def test_no_class_is_longer_than_one_hundred_and_fifty_lines():
    long = []
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 150:
                long.append(f"{path}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long


LAUNCH = PACKAGE / "launch"
ENGINES = {"local", "ray", "slurm"}  # launch/'s engine packages
HOSTS = "hosts"  # what the cluster engines share
LAUNCH_TOP_MOST = 5  # modules at the top of launch/, __init__.py not counted


def _engine_of(module: str) -> str | None:
    """``ray`` for ``taas_magic.launch.ray.backend``; ``hosts`` for the shared package; else None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "launch" and parts[2] in ENGINES | {HOSTS} else None


def test_launch_is_a_contract_and_one_package_per_engine():
    packages = {path.name for path in LAUNCH.iterdir() if (path / "__init__.py").exists()}
    assert packages == ENGINES | {HOSTS}, packages
    top = sorted(path.name for path in LAUNCH.glob("*.py") if path.name != "__init__.py")
    assert len(top) <= LAUNCH_TOP_MOST, top


def test_role_names_repeat_only_under_an_engine():
    """backend.py, courier.py, ...: one per engine; any other file name is the package's only one."""
    seen: dict[str, list[str]] = {}
    for path in _every_module():
        if path.name in ("__init__.py", "__main__.py"):
            continue
        under_engine = path.parent.parent == LAUNCH and path.parent.name in ENGINES
        key = f"engine role {path.name}" if under_engine else path.name
        seen.setdefault(key, []).append(str(path.relative_to(PACKAGE.parent)))
    roles = {key.removeprefix("engine role ") for key in seen if key.startswith("engine role ")}
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1 and not name.startswith("engine role ")}
    assert not roles & {name for name in seen if not name.startswith("engine role ")}, "a role name used outside the engines"


def test_nothing_outside_launch_names_an_engine():
    """The kernel (and every stage) reaches an engine only through launch/contract.py and launch/engines.py."""
    naming = []
    for path, tree in _modules().items():
        module = _module_name(path)
        if module.startswith("taas_magic.launch"):
            continue
        naming += [f"{path} imports {name}" for name in _imported(path, tree) if _engine_of(name) is not None]
    assert not naming, naming


def test_engines_py_is_the_one_module_that_names_the_engines():
    """Inside launch/, an engine's package imports no other engine (the cluster engines share hosts/,
    whose agent runs its ranks with the local engine's processes); the top of launch/ names none,
    but engines.py."""
    crossing = []
    for path, tree in _modules().items():
        module = _module_name(path)
        if not module.startswith("taas_magic.launch"):
            continue
        mine = _engine_of(module)
        for name in _imported(path, tree):
            theirs = _engine_of(name)
            if theirs is None or theirs == mine or path == "taas_magic/launch/engines.py":
                continue
            if theirs == HOSTS and mine in ENGINES - {"local"}:
                continue  # the cluster engines' shared agent and hub
            if mine == HOSTS and name == "taas_magic.launch.local.processes":
                continue  # a host's agent starts its ranks as the local engine does
            crossing.append(f"{path} imports {name}")
    assert not crossing, crossing


def test_the_contract_holds_only_protocols_and_values():
    tree = _modules()["taas_magic/launch/contract.py"]
    assert not [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            protocol = any(isinstance(base, ast.Name) and base.id == "Protocol" for base in node.bases)
            frozen = any(isinstance(d, ast.Call) and any(k.arg == "frozen" for k in d.keywords) for d in node.decorator_list)
            assert protocol or frozen, f"launch/contract.py's {node.name} is neither a Protocol nor a frozen value"


def test_the_supervisor_never_asks_which_backend():
    supervision = [path for path in _modules() if path.startswith("taas_magic/kernel/supervision/")]
    for path in supervision:
        launch = {name for name in _imported(path, _modules()[path]) if name.startswith("taas_magic.launch")}
        assert launch <= {"taas_magic.launch.contract", "taas_magic.launch.rankenv"}, (path, launch)
