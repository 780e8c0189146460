"""The folder layout shows the data flow: imports run one way, and shared helpers live in one place."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "taas_magic"


def _modules() -> dict[str, ast.Module]:
    return {str(path.relative_to(PACKAGE.parent)): ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}


def _imported(path: str, tree: ast.Module) -> set[str]:
    """Absolute names of the taas_magic modules a module imports (relative imports resolved)."""
    package = path.removesuffix(".py").replace("/", ".").rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("taas_magic")}


def test_data_plane_imports_nothing_above_it():
    upward = {"taas_magic.supervisor", "taas_magic.magics", "taas_magic.rank.main"}
    for path, tree in _modules().items():
        if path.startswith("taas_magic/feed/"):
            assert not _imported(path, tree) & upward, (path, _imported(path, tree) & upward)


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


def test_the_magic_and_the_supervisor_never_ask_which_backend():
    concrete = {"LocalRankGroup", "RayRankGroup", "LocalBackend", "ClusterBackend", "ClusterLaunch"}
    supervisor = _modules()["taas_magic/supervisor.py"]
    assert not {node.id for node in ast.walk(supervisor) if isinstance(node, ast.Name)} & concrete
    assert not _imported("taas_magic/supervisor.py", supervisor) & {"taas_magic.launch.local", "taas_magic.launch.ray"}
    magics = _modules()["taas_magic/magics.py"]
    naming = [node.name for node in ast.walk(magics) if isinstance(node, ast.FunctionDef)
              and any(isinstance(n, ast.Name) and n.id in concrete for n in ast.walk(node))]
    assert naming == ["_backend"], naming  # the one place that chooses
