"""The notebook's stand-in for a kept cell's large name left on rank 0 (transfer/keptnames.py): what its repr says
without copying anything, that IPython's display probes never copy it, that the first real touch copies it exactly
once and binds the copy where the name still holds the stand-in (noting it in the real :class:`NameTokens`), what a
stand-in whose ranks ended says, and the module's helpers (``bind``, ``waiting``, ``fetch_waiting``).

The kept ranks are a small explicit stand-in satisfying :class:`KeptRanks` (their processes' identity, why they
ended, whether they run, what they have noted), whose fetch records each call and returns the value rank 0 holds.
(The real rank set's fetch, through the magic's cell: tests/unit/test_rankset.py and tests/kernel/test_keep_lazy.py.)"""

import operator
import pickle

import pytest
import torch
from IPython.core.formatters import DisplayFormatter
from IPython.lib.pretty import pretty

from taas_magic.errors import LaunchError
from taas_magic.kernel.runs.rankset import NameTokens
from taas_magic.transfer import keptnames, pickler
from taas_magic.transfer.keptnames import KeptNameLost, OnTheRanks, bind, fetch_waiting, waiting

BIG = 256 * 2**20  # 268.4 MB
WHERE = "on rank 0 of the kept ranks, not copied here: touching it copies it"


class _Processes:
    """The kept ranks' process group as a stand-in sees it: its identity (a restart makes another) and why it ended."""

    def __init__(self) -> None:
        self.group = object()
        self.why: str | None = None

    def ended_why(self) -> str | None:
        return self.why


class _Kept:
    """Kept ranks (:class:`keptnames.KeptRanks`): their processes, the names they have, whether they run, and how
    rank 0's copy of a name comes (``fetcher``: a :class:`_Fetch`)."""

    def __init__(self) -> None:
        self.ranks = _Processes()
        self.names = NameTokens()
        self.alive = True
        self.fetcher: "_Fetch | None" = None

    @property
    def running(self) -> bool:
        return self.alive

    @property
    def incarnation(self) -> object:
        return self.ranks.group

    def ended_why(self) -> str:
        return self.ranks.ended_why() or "released"

    def fetch(self, name: str) -> object:
        assert self.fetcher is not None
        return self.fetcher(self, name)

    def noted(self, name: str, value: object) -> None:
        self.names.remember({name: value})


def _fetching(kept: _Kept, fetch: "_Fetch") -> _Kept:
    kept.fetcher = fetch
    return kept


class _Fetch:
    """Rank 0's copies by name; every call recorded as (kept ranks, name)."""

    def __init__(self, **values: object) -> None:
        self.values = values
        self.calls: list[tuple[object, str]] = []

    def __call__(self, kept: object, name: str) -> object:
        self.calls.append((kept, name))
        return self.values[name]


class _Box:
    """A plain value rank 0 holds, with attributes (and a weak reference, as a model takes)."""

    def __init__(self, items: list) -> None:
        self.items = items

    def first(self) -> object:
        return self.items[0]


def _proxy(value: object, name: str = "w", type_name: str = "Tensor", nbytes: int = BIG, kept: _Kept | None = None):
    """A stand-in for ``value`` bound to ``name`` in a namespace of its own: (proxy, namespace, kept, fetch)."""
    kept = kept or _Kept()
    fetch = _Fetch(**{name: value})
    namespace: dict = {}
    namespace[name] = OnTheRanks(name, type_name, nbytes, _fetching(kept, fetch), namespace)
    return namespace[name], namespace, kept, fetch


def test_its_repr_and_str_say_what_and_where_it_is_and_copy_nothing():
    proxy, namespace, kept, fetch = _proxy(_Box([1]), nbytes=BIG)
    line = f"<w: Tensor, 268.4 MB, {WHERE}>"
    assert repr(proxy) == line and str(proxy) == line and f"{proxy}" == line and f"{proxy!r}" == line
    assert list(dir(proxy)) == []
    assert fetch.calls == [] and namespace["w"] is proxy


def test_its_size_reads_in_gigabytes_from_a_billion_bytes_and_in_megabytes_below():
    assert repr(_proxy(0, nbytes=3 * 10**9)[0]) == f"<w: Tensor, 3.0 GB, {WHERE}>"
    assert repr(_proxy(0, nbytes=10**9)[0]) == f"<w: Tensor, 1.0 GB, {WHERE}>"
    assert repr(_proxy(0, nbytes=64 * 2**20, type_name="ndarray")[0]) == f"<w: ndarray, 67.1 MB, {WHERE}>"


@pytest.mark.parametrize("probe", ["_repr_html_", "_repr_mimebundle_", "_repr_pretty_", "_ipython_display_",
                                   "_ipython_canary_method_should_not_exist_", "_jupyter_widget_state_",
                                   "_taas_copy", "taas_anything"])
def test_display_probes_and_its_own_names_raise_attribute_error_and_copy_nothing(probe):
    proxy, namespace, _, fetch = _proxy(_Box([1]))
    with pytest.raises(AttributeError, match=f"^{probe}$"):
        getattr(proxy, probe)
    assert not hasattr(proxy, probe)
    assert fetch.calls == [] and namespace["w"] is proxy


def test_ipython_shows_it_as_its_repr_without_copying_it():
    proxy, namespace, _, fetch = _proxy(_Box([1]))
    assert DisplayFormatter().format(proxy) == ({"text/plain": f"<w: Tensor, 268.4 MB, {WHERE}>"}, {})
    assert pretty(proxy) == f"<w: Tensor, 268.4 MB, {WHERE}>"
    assert fetch.calls == [] and namespace["w"] is proxy


def test_the_first_attribute_copies_it_once_binds_the_copy_and_notes_the_ranks_have_it():
    value = _Box([3, 1, 2])
    proxy, namespace, kept, fetch = _proxy(value)
    assert not kept.names.has("w", value)
    assert proxy.items == [3, 1, 2]
    assert fetch.calls == [(kept, "w")]
    assert namespace["w"] is value
    assert kept.names.has("w", value) and kept.names.unsent({"w": value}) == {}
    assert proxy.first() == 3 and proxy.items is value.items  # a closure taken before: its copy, not another fetch
    assert fetch.calls == [(kept, "w")]


TOUCHES = [  # (what it is, the value on rank 0, the touch, what the touch gives)
    ("attribute", [3, 1, 2], lambda p: p.count(1), 1),
    ("call", lambda x: x * 2, lambda p: p(21), 42),
    ("index", [3, 1, 2], lambda p: p[1:], [1, 2]),
    ("len", [3, 1, 2], len, 3),
    ("iter", [3, 1, 2], list, [3, 1, 2]),
    ("contains", [3, 1, 2], lambda p: 2 in p, True),
    ("bool", [], bool, False),
    ("add", 10, lambda p: p + 5, 15),
    ("reflected add", 10, lambda p: 5 + p, 15),
    ("sub", 10, lambda p: p - 3, 7),
    ("reflected sub", 10, lambda p: 3 - p, -7),
    ("mul", 10, lambda p: p * 3, 30),
    ("reflected mul", [1], lambda p: 2 * p, [1, 1]),
    ("truediv", 10, lambda p: p / 4, 2.5),
    ("reflected truediv", 10, lambda p: 5 / p, 0.5),
    ("floordiv", 10, lambda p: p // 3, 3),
    ("reflected floordiv", 10, lambda p: 25 // p, 2),
    ("mod", 10, lambda p: p % 4, 2),
    ("reflected mod", 10, lambda p: 25 % p, 5),
    ("pow", 10, lambda p: p ** 2, 100),
    ("reflected pow", 10, lambda p: 2 ** p, 1024),
    ("matmul", torch.tensor([1.0, 2.0]), lambda p: (p @ torch.tensor([3.0, 4.0])).item(), 11.0),
    ("reflected matmul", torch.tensor([1.0, 2.0]), lambda p: (torch.tensor([3.0, 4.0]) @ p).item(), 11.0),
    ("and", 10, lambda p: p & 6, 2),
    ("reflected and", 10, lambda p: 6 & p, 2),
    ("or", 10, lambda p: p | 5, 15),
    ("reflected or", 10, lambda p: 5 | p, 15),
    ("xor", 10, lambda p: p ^ 3, 9),
    ("reflected xor", 10, lambda p: 3 ^ p, 9),
    ("neg", 10, operator.neg, -10),
    ("pos", -10, operator.pos, -10),
    ("abs", -10, abs, 10),
    ("invert", 10, operator.invert, -11),
    ("lt", 10, lambda p: p < 11, True),
    ("le", 10, lambda p: p <= 9, False),
    ("gt", 10, lambda p: p > 9, True),
    ("ge", 10, lambda p: p >= 11, False),
    ("pickle.dumps", torch.arange(4), lambda p: pickle.loads(pickle.dumps(p)).tolist(), [0, 1, 2, 3]),  # noqa: S301
    ("taas's own pickler", torch.arange(4), lambda p: pickle.loads(pickler.dumps(p)).tolist(), [0, 1, 2, 3]),  # noqa: S301
    ("pickle.dumps of a list", [1, 2], lambda p: pickle.loads(pickle.dumps(p)), [1, 2]),  # noqa: S301
    ("pickle.dumps of a dict", {"a": 1}, lambda p: pickle.loads(pickle.dumps(p)), {"a": 1}),  # noqa: S301
    ("pickle.dumps of an int", 7, lambda p: pickle.loads(pickle.dumps(p)), 7),  # noqa: S301
    ("taas's pickler, a module", torch.nn.Linear(1, 1, bias=False),
     lambda p: type(pickle.loads(pickler.dumps(p))).__name__, "Linear"),  # noqa: S301
    ("eq", 10, lambda p: p == 10, True),
    ("ne", 10, lambda p: p != 10, False),
    ("hash", "w", hash, hash("w")),
    ("format", 2.5, lambda p: f"{p:.2f}", "2.50"),
]


@pytest.mark.parametrize("value, touch, gives", [case[1:] for case in TOUCHES], ids=[case[0] for case in TOUCHES])
def test_each_kind_of_touch_copies_it_exactly_once_and_binds_the_copy(value, touch, gives):
    proxy, namespace, kept, fetch = _proxy(value)
    assert touch(proxy) == gives
    assert fetch.calls == [(kept, "w")]
    assert namespace["w"] is value and kept.names.has("w", value)
    assert touch(proxy) == gives  # the stand-in a closure still holds: the same copy
    assert fetch.calls == [(kept, "w")]


def test_setting_an_attribute_or_an_item_sets_it_on_the_copy():
    value = _Box([3, 1, 2])
    proxy, namespace, kept, fetch = _proxy(value)
    proxy.label = "weights"
    proxy.items[0] = 9
    assert value.label == "weights" and value.items == [9, 1, 2] and "label" not in vars(proxy)
    listed, listed_namespace, listed_kept, listed_fetch = _proxy([3, 1, 2], name="xs")
    listed[2] = 7
    assert listed_namespace["xs"] == [3, 1, 7] and listed_fetch.calls == [(listed_kept, "xs")]
    assert fetch.calls == [(kept, "w")] and namespace["w"] is value


def test_a_name_bound_to_something_else_since_keeps_it_and_the_copy_still_comes_back():
    value = _Box([3, 1, 2])
    proxy, namespace, kept, fetch = _proxy(value)
    namespace["w"] = "rebound in the notebook"
    assert proxy.first() == 3
    assert fetch.calls == [(kept, "w")]
    assert namespace == {"w": "rebound in the notebook"}
    assert kept.names.has("w", value) and not kept.names.has("w", "rebound in the notebook")


def test_a_name_whose_ranks_died_is_lost_and_says_its_name_type_size_and_why():
    value = _Box([1])
    proxy, namespace, kept, fetch = _proxy(value)
    kept.alive, kept.ranks.why = False, "rank 1 was killed by SIGKILL"
    with pytest.raises(KeptNameLost) as lost:
        proxy.first()
    assert str(lost.value) == (
        "taas: w (Tensor, 268.4 MB) stayed on rank 0 of the kept ranks, which ended (rank 1 was killed by SIGKILL) "
        "before it was touched: it did not come back. Run the cell that made it again "
        "(TaasMagics.lazy_bytes = 0 brings every name back at once)")
    assert isinstance(lost.value, LaunchError)
    assert fetch.calls == [] and namespace["w"] is proxy and not kept.names.has("w", value)
    with pytest.raises(KeptNameLost):
        len(proxy)
    with pytest.raises(KeptNameLost):
        pickle.dumps(proxy)
    assert fetch.calls == []


def test_a_name_whose_ranks_were_released_says_released():
    proxy, namespace, kept, fetch = _proxy(0, type_name="ndarray", nbytes=3 * 10**9)
    kept.alive = False  # closed on purpose: no rank died, nothing to say why
    with pytest.raises(KeptNameLost, match=r"^taas: w \(ndarray, 3\.0 GB\) stayed on rank 0 of the kept ranks, which "
                                           r"ended \(released\) before it was touched: it did not come back\."):
        proxy + 1
    assert fetch.calls == [] and namespace["w"] is proxy


def test_a_name_whose_ranks_were_restarted_is_lost_even_while_the_new_ones_run():
    proxy, namespace, kept, fetch = _proxy(_Box([1]))
    kept.ranks.group = object()  # another process group in the same kept ranks: new ranks, without its value
    assert kept.running
    with pytest.raises(KeptNameLost, match=r"^taas: w \(Tensor, 268\.4 MB\) stayed on rank 0 of the kept ranks"):
        proxy.first()
    assert not proxy.taas_held_by(kept)
    assert fetch.calls == [] and namespace["w"] is proxy


def test_a_copy_already_made_survives_its_ranks_ending():
    value = _Box([1])
    proxy, namespace, kept, fetch = _proxy(value)
    assert proxy.taas_fetch() is value
    kept.alive, kept.ranks.why = False, "rank 0 exited with code 1"
    assert proxy.taas_fetch() is value and proxy.items == [1]
    assert fetch.calls == [(kept, "w")]


def test_it_is_held_by_its_own_running_ranks_until_it_is_copied():
    proxy, _, kept, fetch = _proxy(_Box([1]))
    other = _Kept()
    assert proxy.taas_held_by(kept) and not proxy.taas_held_by(other)
    kept.alive = False
    assert not proxy.taas_held_by(kept)
    kept.alive = True
    proxy.taas_fetch()
    assert not proxy.taas_held_by(kept)
    assert fetch.calls == [(kept, "w")]


def test_bind_binds_a_stand_in_for_each_name_left_on_the_ranks_and_copies_nothing():
    kept = _Kept()
    fetch = _Fetch(model=_Box(["m"]), grads=_Box(["g"]))
    namespace: dict = {"lr": 0.1, "model": "the notebook's old model"}
    bind(namespace, [("model", "DistributedDataParallel", BIG), ("grads", "dict", 3 * 10**9)], _fetching(kept, fetch))
    assert namespace["lr"] == 0.1
    assert repr(namespace["model"]) == f"<model: DistributedDataParallel, 268.4 MB, {WHERE}>"
    assert repr(namespace["grads"]) == f"<grads: dict, 3.0 GB, {WHERE}>"
    assert fetch.calls == []
    assert namespace["grads"].items == ["g"]  # each stand-in copies its own name into the namespace bind was given
    assert fetch.calls == [(kept, "grads")] and namespace["grads"] is fetch.values["grads"]
    assert isinstance(namespace["model"], OnTheRanks)


def test_waiting_lists_the_names_still_bound_to_a_stand_in_of_these_running_ranks():
    kept, other = _Kept(), _Kept()
    fetch = _Fetch(a=_Box([1]), b=_Box([2]), c=_Box([3]))
    namespace: dict = {"plain": 1}
    bind(namespace, [("a", "Tensor", BIG), ("b", "Tensor", BIG)], _fetching(kept, fetch))
    bind(namespace, [("c", "Tensor", BIG)], _fetching(other, fetch))
    namespace["alias"] = namespace["a"]
    assert waiting(namespace, kept) == ["a", "b", "alias"]
    assert waiting(namespace, other) == ["c"]
    namespace["b"].taas_fetch()
    assert waiting(namespace, kept) == ["a", "alias"]
    kept.alive = False
    assert waiting(namespace, kept) == []
    assert fetch.calls == [(kept, "b")]


def test_fetch_waiting_copies_every_stand_in_of_these_ranks_once_and_leaves_the_others():
    kept, other = _Kept(), _Kept()
    fetch = _Fetch(a=_Box([1]), b=_Box([2]), c=_Box([3]))
    namespace: dict = {"plain": 1}
    bind(namespace, [("a", "Tensor", BIG), ("b", "Tensor", BIG)], _fetching(kept, fetch))
    bind(namespace, [("c", "Tensor", BIG)], _fetching(other, fetch))
    stand_in_a = namespace["a"]
    namespace["alias"] = stand_in_a
    fetch_waiting(namespace, kept)
    assert sorted(fetch.calls, key=lambda call: call[1]) == [(kept, "a"), (kept, "b")]
    assert namespace["a"] is fetch.values["a"] and namespace["b"] is fetch.values["b"]
    assert namespace["alias"] is stand_in_a and namespace["alias"].items == [1]  # its copy, not fetched again
    assert isinstance(namespace["c"], OnTheRanks) and namespace["plain"] == 1
    assert waiting(namespace, kept) == [] and waiting(namespace, other) == ["c"]
    assert len(fetch.calls) == 2


def test_fetch_waiting_without_kept_ranks_does_nothing():
    proxy, namespace, kept, fetch = _proxy(_Box([1]))
    fetch_waiting(namespace, None)
    assert fetch.calls == [] and namespace["w"] is proxy


def test_the_default_lazy_size_is_64_mib():
    assert keptnames.LAZY_BYTES == 67108864
