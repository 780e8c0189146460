"""What an exported job takes of the notebook: the definitions a cell uses, by their source; its imports; its values.

Runs in the kernel, on the cell's thread (``%taas export``, export/command.py).

Starting from the cell's closure (the notebook names it reads: cell/closure.py), each name is one of:

- a module (``np``): an import line (``import numpy as np``);
- a function or class of a library (``DataLoader``): an import line, where importing it gives that very object;
- a function, class or lambda defined in a notebook cell: its source, the cell's own lines (decorators kept), taken
  from the last cell that defined it at the top level; the names *its* body reads are carried too, in turn, and so
  is every notebook class or function a value's pickle names (``__main__.Squares`` in a DataLoader's dataset);
- anything else: a value, pickled beside the script (the job loads them after the definitions, so an instance
  of a notebook class finds its class).

A name that cannot go (an open file, a socket, a generator, a lambda not bound at a cell's top level) raises
:class:`ExportError` naming it: one line, and no file is written.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import io
import pickle
import pickletools
import symtable
import textwrap
import types
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from taas_magic.errors import LaunchError


class ExportError(LaunchError):
    """A cell that cannot become a job, and why: one line."""


@dataclass(frozen=True)
class Definition:
    name: str
    cell: int  # the In[N] that defined it
    line: int  # its first line there (decorators included)
    source: str


@dataclass
class Carried:
    imports: dict[str, str] = field(default_factory=dict)  # name -> its import line
    definitions: dict[str, Definition] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    loaders: list[str] = field(default_factory=list)  # values that are registered loaders: fed as the data workers do

    def ordered_definitions(self) -> list[Definition]:
        """In the order the notebook ran them: a class's base, defined in an earlier cell, comes first."""
        return sorted(self.definitions.values(), key=lambda d: (d.cell, d.line))


def carry(closure: Mapping[str, Any], namespace: Mapping[str, Any], cells: Mapping[int, str],
          registered: Sequence[Any] = ()) -> Carried:
    """What the job takes for ``closure`` (``cells``: the notebook's cells by number, as Python; ``registered``:
    the loaders ``taas.register`` holds, which the job feeds to its ranks as the data workers would)."""
    walk = _Walk(namespace, cells, registered)
    waiting = sorted(closure)
    while waiting:
        walk.take_all(waiting)
        for name, value in walk.carried.values.items():  # what the values' pickles name of the notebook goes too
            said = name + (f", which {walk.wanted_by[name]} reads," if name in walk.wanted_by else "")
            walk.want(sorted(_check_picklable(said, value)), name, waiting)
    return walk.carried


@dataclass
class _Walk:
    """:func:`carry`'s walk over the notebook's names: what it decided, and which name asked for which."""

    namespace: Mapping[str, Any]
    cells: Mapping[int, str]
    registered: Sequence[Any]
    carried: Carried = field(default_factory=Carried)
    seen: set[str] = field(default_factory=set)
    wanted_by: dict[str, str] = field(default_factory=dict)  # a name carried for what reads it -> that name

    def want(self, names: list[str], by: str, waiting: list[str]) -> None:
        for read in names:
            if read not in self.seen:
                self.wanted_by.setdefault(read, by)
                waiting.append(read)

    def take_all(self, waiting: list[str]) -> None:
        """Each name of ``waiting`` decided (an import, a definition, a value), and what definitions read in turn."""
        carried, namespace = self.carried, self.namespace
        while waiting:
            name = waiting.pop(0)
            if name in self.seen or name not in namespace:
                continue
            self.seen.add(name)
            value = namespace[name]
            line = _import_line(name, value)
            if line is not None:
                carried.imports[name] = line
                continue
            if _defined_in_a_cell(value):
                definition, reads = _definition(name, value, self.cells)
                carried.definitions[name] = definition
                self.want(sorted(reads), name, waiting)
                continue
            kind = type(value)
            if kind.__module__ == "__main__":  # an instance of a notebook class: the class goes too
                self.want([n for n, v in namespace.items() if v is kind], name, waiting)
            carried.values[name] = value
            if any(value is loader for loader in self.registered):
                carried.loaders.append(name)


def _import_line(name: str, value: Any) -> str | None:
    if isinstance(value, types.ModuleType):
        dotted: str = value.__name__
        if "." in dotted:
            parent, _, leaf = dotted.rpartition(".")
            return f"from {parent} import {leaf}" if leaf == name else f"import {dotted} as {name}"
        return f"import {dotted}" if dotted == name else f"import {dotted} as {name}"
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or module == "__main__" or "<" in qualname:
        return None
    if not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    if found is not value or "." in qualname:
        return None
    return f"from {module} import {qualname}" + ("" if qualname == name else f" as {name}")


def _defined_in_a_cell(value: Any) -> bool:
    return (isinstance(value, (type, types.FunctionType)) and getattr(value, "__module__", None) == "__main__")


def _definition(name: str, value: Any, cells: Mapping[int, str]) -> tuple[Definition, set[str]]:
    """The last top-level definition of ``name`` in the cells (``def``, ``class``, or ``name = lambda ...``)."""
    for number in sorted(cells, reverse=True):
        source = cells[number]
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in reversed(tree.body):
            if _defines(node, name):
                first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
                lines = source.splitlines(keepends=True)[first - 1: node.end_lineno]
                reads = _global_reads("".join(lines)) - set(dir(builtins)) - {name}
                return Definition(name, number, first, "".join(lines)), reads
    kind = "lambda" if getattr(value, "__name__", "") == "<lambda>" else type(value).__name__
    raise ExportError(f"taas: {name} (a {kind} made in the notebook) cannot go with the job: no cell defines it at "
                      f"its top level as `def {name}`, `class {name}` or `{name} = lambda ...`")


def _global_reads(source: str) -> set[str]:
    """The module-level names a definition reads (its decorators, bases and defaults, and the globals its bodies
    use), from Python's own symbol tables: a parameter or local of the same name as a notebook value is not one."""
    top = symtable.symtable(textwrap.dedent(source), "<definition>", "exec")
    reads = {symbol.get_name() for symbol in top.get_symbols() if symbol.is_referenced()}
    tables = list(top.get_children())
    while tables:
        table = tables.pop()
        tables.extend(table.get_children())
        reads |= {symbol.get_name() for symbol in table.get_symbols() if symbol.is_global() and symbol.is_referenced()}
    return reads


def _defines(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign) and isinstance(node.value, ast.Lambda):
        return any(isinstance(target, ast.Name) and target.id == name for target in node.targets)
    return False


class _Probe(pickle.Pickler):
    """Pickles as the job's loader will unpickle: a notebook class by reference (the script defines it)."""

    def persistent_id(self, obj: Any) -> Any:
        storage = getattr(obj, "untyped_storage", None)
        return ("tensor", id(obj)) if storage is not None and type(obj).__module__.startswith("torch") else None


def _check_picklable(name: str, value: Any) -> set[str]:
    """The notebook names ``value``'s pickle refers to (``__main__.Net``: the job must define them first)."""
    if isinstance(value, types.GeneratorType):
        raise ExportError(f"taas: {name} (a generator) cannot go with the job: make it in the cell, or a list")
    buffer = io.BytesIO()
    try:
        _Probe(buffer, protocol=5).dump(value)
    except Exception as exc:  # noqa: BLE001 - any reason it cannot be pickled: said in one line
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        raise ExportError(f"taas: {name} ({type(value).__qualname__}) cannot go with the job: {reason}") from None
    pushed: list[object] = []  # what each opcode pushed, as far as strings go (the module and name STACK_GLOBAL takes)
    memo: list[object] = []
    named = set()
    for opcode, argument, _ in pickletools.genops(buffer.getvalue()):
        if opcode.name == "MEMOIZE":
            memo.append(pushed[-1] if pushed else None)
        elif opcode.name in ("BINGET", "LONG_BINGET") and isinstance(argument, int) and argument < len(memo):
            pushed.append(memo[argument])
        elif "UNICODE" in opcode.name:
            pushed.append(argument)
        elif opcode.name == "STACK_GLOBAL" and len(pushed) >= 2 and pushed[-2] == "__main__":
            named.add(str(pushed[-1]).split(".")[0])
        else:
            pushed.append(None)
    return named
