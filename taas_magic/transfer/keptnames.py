"""Rank 0's large names from kept cells: bound in the notebook as :class:`OnTheRanks`, copied when first touched.

Runs in the kernel, on the cell's thread: proxies are bound as a kept cell's results are (kernel/runs/rankset.py),
and fetched by whatever notebook code touches one, or by the magic before the kept ranks end.

A kept cell's rank 0 leaves each name it bound whose tensors and arrays hold ``TaasMagics.lazy_bytes`` or more
on the ranks (transfer/returns.py: unless a name that does come back reaches it), and the notebook binds an
:class:`OnTheRanks` in its place: its repr says what and where it is, and copies nothing. The first touch
(an attribute, a call, an index, arithmetic, ``len``, ``iter``, pickling it: a plain cell's closure, say) copies
it: the ranks that hold it (:class:`KeptRanks`, kernel/runs/rankset.py's rank set) fetch it, by one kept cell on
the same ranks whose last line is that name (so it comes back as any final value does, DDP and compiled wrappers as
their module, CUDA tensors by CUDA IPC); the stand-in binds the copy to the name (where the name still holds the
proxy) and the ranks note that they have it, so the next kept cell does not send it back. A kept cell that reads
the name never copies it: the ranks have their own.

Before the kept ranks end on purpose (``%taas release``, a ``--keep`` cell of another shape, another cluster),
every proxy the notebook still holds is fetched first: nothing the person kept a name to is lost. When they
end otherwise (a rank died, a failure restarted them, the kernel's extension unloaded), a proxy left behind
says so when touched, and what to do. IPython's display hooks (``_repr_*_``, ``_ipython_*``) never fetch.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, MutableMapping, Protocol

from taas_magic.errors import LaunchError

LAZY_BYTES = 64 * 2**20  # TaasMagics.lazy_bytes's default
_NEVER_FETCHED = ("_repr_", "_ipython_", "_jupyter_")  # IPython's display and inspection probe these


class KeptRanks(Protocol):
    """What a stand-in asks of the kept ranks that hold its value (kernel/runs/rankset.py's rank set, which binds it)."""

    @property
    def running(self) -> bool:
        """Their processes run."""

    @property
    def incarnation(self) -> object:
        """Which processes they are: new ranks (a rank died, a failure stopped them) are another."""

    def ended_why(self) -> str:
        """Why they ended, once they did."""

    def fetch(self, name: str) -> object:
        """``name``'s value on rank 0, copied here."""

    def noted(self, name: str, value: object) -> None:
        """The ranks have ``value`` as ``name`` (the next kept cell need not send it)."""


class KeptNameLost(LaunchError):
    """A proxy whose ranks ended before it was copied."""


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


class OnTheRanks:
    """A name rank 0 of the kept ranks holds, not yet copied here (see the module docstring)."""

    def __init__(self, name: str, type_name: str, nbytes: int, kept: KeptRanks, namespace: MutableMapping[str, Any]):
        # object.__setattr__ throughout: a proxy's own attributes are never the value's
        for key, value in (("_taas_name", name), ("_taas_type", type_name), ("_taas_nbytes", nbytes),
                           ("_taas_kept", kept), ("_taas_incarnation", kept.incarnation), ("_taas_namespace", namespace)):
            object.__setattr__(self, key, value)

    def _taas_here(self) -> bool:
        """Whether the ranks that hold it are the ones running now (not ended, not restarted since)."""
        kept = self._taas_kept
        return kept.running and kept.incarnation is self._taas_incarnation

    def taas_fetch(self) -> Any:
        """The value, copied from rank 0 now and bound to the name in place of this proxy (once)."""
        return self._taas_value()

    def _taas_value(self) -> Any:
        """The value, copied from rank 0 now and bound to the name in place of this proxy."""
        name = self._taas_name
        if "_taas_copy" in self.__dict__:  # fetched already (a closure taken before that holds this proxy)
            return self.__dict__["_taas_copy"]
        if not self._taas_here():
            why = self._taas_kept.ended_why()
            raise KeptNameLost(f"taas: {name} ({self._taas_type}, {_size(self._taas_nbytes)}) stayed on rank 0 of the "
                               f"kept ranks, which ended ({why}) before it was touched: it did not come back. Run the "
                               "cell that made it again (TaasMagics.lazy_bytes = 0 brings every name back at once)")
        value = self._taas_kept.fetch(name)
        object.__setattr__(self, "_taas_copy", value)
        namespace = self._taas_namespace
        if namespace.get(name) is self:
            namespace[name] = value
        self._taas_kept.noted(name, value)
        return value

    def taas_held_by(self, kept: KeptRanks) -> bool:
        """Whether ``kept``'s ranks, running now, hold its value (not fetched yet)."""
        return self._taas_kept is kept and self._taas_here() and "_taas_copy" not in self.__dict__

    def __repr__(self) -> str:
        return (f"<{self._taas_name}: {self._taas_type}, {_size(self._taas_nbytes)}, on rank 0 of the kept ranks, "
                "not copied here: touching it copies it>")

    __str__ = __repr__

    def __dir__(self) -> Iterable[str]:
        return ()

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith(_NEVER_FETCHED) or attribute.startswith(("_taas_", "taas_")):
            raise AttributeError(attribute)
        return getattr(self._taas_value(), attribute)

    def __setattr__(self, attribute: str, value: Any) -> None:
        setattr(self._taas_value(), attribute, value)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # the value itself, pickled inside: its own reduce would be checked against this class and refused
        return (_itself, (self._taas_value(),))

    def __eq__(self, other: object) -> bool:
        return bool(self._taas_value() == other)

    def __ne__(self, other: object) -> bool:
        return bool(self._taas_value() != other)

    def __hash__(self) -> int:
        return hash(self._taas_value())

    def __format__(self, spec: str) -> str:
        return format(self._taas_value(), spec) if spec else str(self)  # f"{w}" is its repr, as str(w): no copy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._taas_value()(*args, **kwargs)

    def __getitem__(self, key: Any) -> Any:
        return self._taas_value()[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._taas_value()[key] = value

    def __len__(self) -> int:
        return len(self._taas_value())

    def __iter__(self) -> Any:
        return iter(self._taas_value())

    def __contains__(self, item: Any) -> bool:
        return item in self._taas_value()

    def __bool__(self) -> bool:
        return bool(self._taas_value())


def _itself(value: Any) -> Any:
    """A proxy unpickled: the value it was copied as."""
    return value


def _delegate(operation: Callable[..., Any], reflected: bool = False) -> Callable[..., Any]:
    if reflected:
        return lambda self, other: operation(other, self._taas_value())
    return lambda self, *others: operation(self._taas_value(), *others)


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and_", "or_", "xor"):
    _dunder = _name.rstrip("_")
    setattr(OnTheRanks, f"__{_dunder}__", _delegate(getattr(operator, _name)))
    setattr(OnTheRanks, f"__r{_dunder}__", _delegate(getattr(operator, _name), reflected=True))
for _name in ("neg", "pos", "abs", "invert", "lt", "le", "gt", "ge"):
    setattr(OnTheRanks, f"__{_name}__", _delegate(getattr(operator, _name)))


def bind(namespace: MutableMapping[str, Any], kept_back: Iterable[tuple[str, str, int]], kept: KeptRanks) -> None:
    """Rank 0's names a kept cell left on the ranks, bound in the notebook as proxies."""
    for name, type_name, nbytes in kept_back:
        namespace[name] = OnTheRanks(name, type_name, nbytes, kept, namespace)


def waiting(namespace: MutableMapping[str, Any], kept: KeptRanks) -> list[str]:
    """The notebook's names still bound to a proxy of ``kept``'s ranks now running."""
    return [name for name, value in list(namespace.items()) if isinstance(value, OnTheRanks) and value.taas_held_by(kept)]


def fetch_waiting(namespace: MutableMapping[str, Any], kept: KeptRanks | None) -> None:
    """Before the kept ranks end on purpose: every proxy the notebook still holds copied here."""
    if kept is None:
        return
    for name in waiting(namespace, kept):
        value = namespace[name]
        if isinstance(value, OnTheRanks):
            value.taas_fetch()
