"""The notebook names a cell may read before it binds them: what its closure must hold.

Runs in the kernel, on the cell's thread (cell/closure.py calls it); pure.

A cell that is run again (the edit-and-run loop) mentions every name its last run bound:
``model = Net()``, ``opt = SGD(...)``, ``for x, y in loader``. Shipping all of those would
pickle last run's model and optimizer into every rank only for the cell to replace them
(and a value that cannot be pickled would fail a cell that never reads it). So a name is
shipped only where the cell may read it while it is not yet bound in this run.

The analysis is conservative; it only ever errs towards shipping a name:

- statements run in order, and a top-level statement that raises ends the cell, so a
  name bound by an earlier top-level statement (assignment, import, ``def``, ``class``)
  is bound for everything after it. ``if`` binds what both branches bind; the body of a
  ``for``, ``while``, ``with`` or ``try`` binds nothing for what follows (it may not run,
  or stop half-way), though its own later statements see its earlier bindings; a
  ``with``'s ``as`` targets and a ``finally`` block's bindings do count after it;
- a read inside a function, lambda or class body counts where the ``def`` stands: the
  body cannot run before the ``def`` did. A name read in a nested scope counts even
  when it is that scope's own local (shipping it is harmless);
- a name the cell deletes anywhere (``del x``, ``except E as x``) is always shipped, so
  its deletion reaches the notebook as before; identifiers inside the strings IPython
  makes of ``!cmd $x`` and ``%time f(x)`` are reads, and bind nothing;
- ``match``, walrus targets, star imports and loop targets bind nothing here.
"""

from __future__ import annotations

import ast
import re

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TRY = (ast.Try, ast.TryStar) if hasattr(ast, "TryStar") else (ast.Try,)


def _is_get_ipython_call(node: ast.AST) -> bool:
    """``get_ipython().something(...)``, IPython's translation of ``!`` and ``%``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Call)
        and isinstance(node.func.value.func, ast.Name)
        and node.func.value.func.id == "get_ipython"
    )


def reads(node: ast.AST) -> set[str]:
    """Every name the code may read: any name not being stored, augmented targets,
    ``global``/``nonlocal`` names, and identifiers in IPython command strings."""
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and not isinstance(sub.ctx, ast.Store):
            names.add(sub.id)
        elif isinstance(sub, ast.AugAssign) and isinstance(sub.target, ast.Name):
            names.add(sub.target.id)
        elif isinstance(sub, (ast.Global, ast.Nonlocal)):
            names.update(sub.names)
        elif isinstance(sub, ast.Call) and _is_get_ipython_call(sub):
            for arg in sub.args:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    names.update(_IDENTIFIER.findall(arg.value))
    return names


def _deleted(tree: ast.AST) -> set[str]:
    """``del x`` and ``except E as x`` (which deletes ``x`` when the handler ends), anywhere."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Del):
            names.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


def _target_names(target: ast.AST) -> set[str]:
    """Names an assignment target binds for certain (attributes and items bind none)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_target_names(element) for element in target.elts))
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    return set()


class _Flow:
    def __init__(self, never_bound: set[str]):
        self.never_bound = never_bound  # deleted somewhere: treated as never bound
        self.free: set[str] = set()

    def read(self, node: ast.AST | None, bound: set[str]) -> None:
        if node is not None:
            self.free |= reads(node) - bound

    def block(self, statements: list[ast.stmt], bound: set[str]) -> set[str]:
        """Walk ``statements`` with ``bound`` bound on entry; return what is bound after."""
        bound = set(bound)
        for statement in statements:
            bound = self.statement(statement, bound)
        return bound

    def statement(self, node: ast.stmt, bound: set[str]) -> set[str]:
        binds: set[str] = set()
        if isinstance(node, ast.Assign):
            self.read(node, bound)  # its stores are not reads; any subscript or attribute base is
            binds = set().union(*(_target_names(target) for target in node.targets))
        elif isinstance(node, ast.AnnAssign):
            self.read(node, bound)
            if node.value is not None:
                binds = _target_names(node.target)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            binds = {alias.asname or alias.name.split(".")[0] for alias in node.names if alias.name != "*"}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.read(node, bound)
            binds = {node.name}
        elif isinstance(node, ast.If):
            self.read(node.test, bound)
            binds = self.block(node.body, bound) & self.block(node.orelse, bound)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self.read(node.iter, bound)
            self.read(node.target, bound)  # a subscript or attribute target reads its base
            self.block(node.body, bound | _target_names(node.target))
            self.block(node.orelse, bound)
        elif isinstance(node, ast.While):
            self.read(node.test, bound)
            self.block(node.body, bound)
            self.block(node.orelse, bound)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                self.read(item.context_expr, bound)
                if item.optional_vars is not None:
                    self.read(item.optional_vars, bound)
                    binds |= _target_names(item.optional_vars)  # bound before the body runs
            self.block(node.body, bound | binds)
        elif isinstance(node, _TRY):
            completed = self.block(node.body, bound)
            self.block(node.orelse, completed)  # runs only after the body completed
            for handler in node.handlers:
                self.read(handler.type, bound)
                self.block(handler.body, bound | ({handler.name} if handler.name else set()))
            binds = self.block(node.finalbody, bound)
        else:  # expressions, del, return, match, ...: reads everything, binds nothing for certain
            self.read(node, bound)
        return bound | (binds - self.never_bound)


def free_names(tree: ast.Module) -> set[str]:
    """The names ``tree`` may read before binding them (a superset: see the module doc)."""
    deleted = _deleted(tree)
    flow = _Flow(deleted)
    flow.block(tree.body, set())
    return flow.free | deleted
