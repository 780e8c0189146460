"""The gather's decisions, without ranks: the limit, the agreement, whole or a handle, and the
deferred destroy (transfer/sharded.py, rank/groups.py). The gather itself, through a real kernel:
tests/kernel/test_sharded_results.py."""

from __future__ import annotations

import sys
import types

import pytest

from taas_magic.rank import groups
from taas_magic.transfer import sharded
from taas_magic.transfer.sharded import _agree, _decide, _Plan, gather_limit


def _meminfo(tmp_path, kilobytes: int) -> str:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       8000000 kB\nMemFree:        1000000 kB\nMemAvailable:   {kilobytes} kB\n")
    return str(path)


@pytest.mark.parametrize(("variable", "expected"), [
    (None, (2_048_000_000, "half of this host's 4.1 GB free at launch")),
    ("1000", (1000, "TAAS_GATHER_MAX_BYTES=1000")),
    ("9" * 20, (2_048_000_000, "half of this host's 4.1 GB free at launch")),  # it lowers the limit, never raises it
    ("lots", (2_048_000_000, "half of this host's 4.1 GB free at launch")),
])
def test_the_limit_is_half_the_hosts_free_memory_lowered_by_the_variable(tmp_path, monkeypatch, variable, expected):
    if variable is None:
        monkeypatch.delenv(sharded.LIMIT_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(sharded.LIMIT_VARIABLE, variable)
    assert gather_limit(_meminfo(tmp_path, 4_000_000)) == expected


def test_without_meminfo_there_is_no_limit_unless_the_variable_sets_one(tmp_path, monkeypatch):
    monkeypatch.delenv(sharded.LIMIT_VARIABLE, raising=False)
    assert gather_limit(str(tmp_path / "absent")) == (0, "")
    monkeypatch.setenv(sharded.LIMIT_VARIABLE, "512")
    assert gather_limit(str(tmp_path / "absent")) == (512, "TAAS_GATHER_MAX_BYTES=512")


class _Group:
    """``torch.distributed`` as ``_agree`` sees it: each rank's plans, exchanged."""

    def __init__(self, *ranks: dict):
        self.ranks = ranks

    def get_world_size(self) -> int:
        return len(self.ranks)

    def all_gather_object(self, out: list, mine: dict) -> None:
        assert mine == self.ranks[0]
        out[:] = self.ranks


def _dt(rows: int) -> tuple:
    return ("dt", (rows, 4), "torch.float32", "(Shard(dim=0),)")


def test_only_the_names_every_rank_plans_alike_are_agreed():
    model = [("fsdp", "Net"), _dt(4), _dt(4)]
    rank0 = {"model": model, "odd": [_dt(4)], "view": [("alias", "odd")], "same": [("same", "model")], "<final value>": [("same", "model")]}
    rank1 = {"model": model, "odd": [_dt(6)], "view": [("alias", "odd")], "same": [("same", "model")], "only_here": [_dt(2)],
             "<final value>": [("same", "model")]}
    plans = {name: _Plan(entries=entries) for name, entries in rank0.items()}
    agreed = _agree(_Group(rank0, rank1), plans)  # type: ignore[arg-type]
    assert agreed == ["model", "same", "<final value>"]  # odd differs; view aliases odd; only_here is not rank 0's


def test_names_come_back_whole_within_the_limit_and_as_handles_past_it():
    plans = {"a": _Plan(entries=[_dt(4)], nbytes=60), "b": _Plan(entries=[_dt(4)], nbytes=60),
             "b_too": _Plan(entries=[("same", "b")]), "part_of_b": _Plan(entries=[("alias", "b")]),
             "c": _Plan(entries=[_dt(4)], nbytes=30)}
    decision = _decide(list(plans), plans, limit=100, folder="/run")
    assert decision.whole == ["a", "c"]  # b does not fit after a; c still does
    # the same object: one checkpoint, one handle; sharing some of b's DTensors: a checkpoint of its own
    assert decision.handles == {"b": "/run/whole-b", "b_too": "/run/whole-b", "part_of_b": "/run/whole-part_of_b"}
    assert decision.room == {"b": 40} and not decision.failed
    assert _decide(list(plans), plans, limit=0, folder=None).whole == list(plans)  # no limit: everything whole
    nowhere = _decide(list(plans), plans, limit=100, folder=None)  # too big, and no folder to save it in
    assert nowhere.failed == {"b": "60 B whole, too big to come back, and the run has no checkpoint folder",
                              "b_too": "shares DTensors with b", "part_of_b": "shares DTensors with b"}


@pytest.fixture
def dist(monkeypatch):
    """A ``torch.distributed`` with a default group, its destroys recorded, DTensor imported."""
    calls: list = []
    module = types.ModuleType("fake_distributed")
    module.group = types.SimpleNamespace(WORLD=object())  # type: ignore[attr-defined]
    module.is_initialized = lambda: True  # type: ignore[attr-defined]
    module.destroy_process_group = lambda group=None: calls.append(("destroy", group))  # type: ignore[attr-defined]
    module.init_process_group = lambda *args, **kwargs: calls.append(("init", args))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, groups.DTENSOR, types.ModuleType(groups.DTENSOR))
    groups.defer_destroy(module)
    groups.defer_destroy(module)  # wrapped once only
    module.calls = calls  # type: ignore[attr-defined]
    yield module
    groups.finish_destroy()


def test_the_default_groups_destroy_waits_for_the_gather(dist):
    dist.destroy_process_group()
    assert dist.calls == []
    groups.finish_destroy()
    groups.finish_destroy()  # once
    assert dist.calls == [("destroy", None)]


def test_an_init_after_a_deferred_destroy_destroys_first_and_other_groups_go_at_once(dist):
    dist.destroy_process_group(dist.group.WORLD)
    dist.init_process_group("gloo")
    subgroup = object()
    dist.destroy_process_group(subgroup)
    assert dist.calls == [("destroy", None), ("init", ("gloo",)), ("destroy", subgroup)]


def test_without_dtensor_a_destroy_is_done_at_once(dist, monkeypatch):
    monkeypatch.delitem(sys.modules, groups.DTENSOR)
    dist.destroy_process_group()
    assert dist.calls == [("destroy", None)]
