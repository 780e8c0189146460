"""Wrappers that travel as the module they wrap (transfer/unwrap.py), on real wrappers: DDP and FSDP in a
one-process gloo group, ``DataParallel``, ``torch.compile``'s ``OptimizedModule``; and FSDP sharded over two
real ranks (two forked processes), which rank 0 alone cannot give back whole; and a fresh interpreter, which
recognises them without importing FSDP or dynamo."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.nn.parallel import DistributedDataParallel

from taas_magic.transfer.unwrap import same, unwrap
from tests.unit.gloo import forked_ranks, one_rank_group

ROOT = Path(__file__).resolve().parents[2]
SHARDED = ("FullyShardedDataParallel holds only this rank's shard of each parameter; gather a full state dict in the "
           "cell (FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT)) and bind that")
FLATTENED = ("FullyShardedDataParallel(use_orig_params=False) keeps the module's parameters flattened into one; wrap "
             "with use_orig_params=True, or bind model.state_dict()")


@pytest.fixture(scope="module")
def group():
    """A one-process gloo group: DDP and FSDP need one to be made at all."""
    with one_rank_group():
        yield


def _fsdp(module, **options):
    """FSDP on one rank: it says it shards nothing, as a world of one."""
    with pytest.warns(UserWarning, match="FSDP is switching to use `NO_SHARD`"):
        return FullyShardedDataParallel(module, device_id=torch.device("cpu"), **options)


class Distributed(DistributedDataParallel):
    """A person's subclass of DDP: still DDP, by its MRO."""


class Holder(torch.nn.Module):
    """Not a wrapper, though it has a ``module``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_what_is_not_a_wrapper_is_none(group):
    inner = torch.nn.Linear(2, 2)
    assert unwrap(inner) is None and unwrap(Holder(inner)) is None
    assert unwrap(3) is None and unwrap({"model": inner}) is None and unwrap(None) is None
    sharded = torch.nn.Linear(2, 2)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))  # FSDP2 changes the module itself: no wrapper
    assert unwrap(sharded) is None


def test_each_wrapper_comes_back_as_the_module_it_wraps_by_identity(group):
    inner = torch.nn.Linear(2, 2)
    assert unwrap(DistributedDataParallel(inner)) == (inner, "DistributedDataParallel")
    assert unwrap(torch.nn.DataParallel(inner)) == (inner, "DataParallel")
    assert unwrap(torch.compile(inner, backend="eager")) == (inner, "OptimizedModule")
    assert unwrap(Distributed(inner)) == (inner, "DistributedDataParallel")
    assert same(inner) is inner


def test_nested_wrappers_give_the_innermost_module_and_the_outermost_name(group):
    inner = torch.nn.Linear(2, 2)
    compiled = torch.compile(DistributedDataParallel(inner), backend="eager")
    assert unwrap(compiled) == (inner, "OptimizedModule")
    assert unwrap(DistributedDataParallel(torch.compile(inner, backend="eager"))) == (inner, "DistributedDataParallel")
    assert unwrap(torch.nn.DataParallel(torch.nn.DataParallel(inner))) == (inner, "DataParallel")


def test_fsdp_with_whole_original_parameters_comes_back_as_its_module(group):
    inner = torch.nn.Linear(2, 2)
    wrapped = _fsdp(inner, use_orig_params=True)
    assert unwrap(wrapped) == (inner, "FullyShardedDataParallel")
    assert unwrap(DistributedDataParallel(_fsdp(inner, use_orig_params=True))) == (inner, "DistributedDataParallel")


def test_fsdp_with_flattened_parameters_is_refused_wherever_it_is_in_the_chain(group):
    with pytest.raises(TypeError) as refused:
        unwrap(_fsdp(torch.nn.Linear(2, 2), use_orig_params=False))
    assert str(refused.value) == FLATTENED
    with pytest.raises(TypeError) as refused:
        unwrap(torch.compile(_fsdp(torch.nn.Linear(2, 2), use_orig_params=False), backend="eager"))
    assert str(refused.value) == FLATTENED


def _fsdp_rank(rank: int, port: int, sends) -> None:
    """One of two ranks (a fork of this process): ``unwrap`` on FSDP modules of each strategy, sharded over both."""
    try:
        from torch.distributed.fsdp import ShardingStrategy

        warnings.simplefilter("ignore")  # NO_SHARD's deprecation
        dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=60))
        report: dict = {}
        for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
            for orig in (True, False):
                inner = torch.nn.Linear(4, 4)
                wrapped = FullyShardedDataParallel(inner, sharding_strategy=getattr(ShardingStrategy, strategy),
                                                   use_orig_params=orig, device_id=torch.device("cpu"))
                try:
                    module, outer = unwrap(wrapped)
                    report[f"{strategy} {orig}"] = [module is inner, outer, wrapped.world_size]
                except TypeError as exc:
                    report[f"{strategy} {orig}"] = str(exc)
        dist.destroy_process_group()
        sends.send(report)
    except BaseException as exc:  # noqa: BLE001 - the test says it
        sends.send(f"{type(exc).__name__}: {exc}")


@pytest.fixture(scope="module", autouse=True)
def two_ranks() -> list:
    """What each of two real ranks reports: forks of this process (its imports, and no group yet: this runs
    first), in one gloo group of their own; both joined, or killed."""
    return forked_ranks(_fsdp_rank)


FRESH = textwrap.dedent("""\
    import json, sys, torch
    from taas_magic.transfer.unwrap import unwrap
    found = [unwrap(torch.nn.DataParallel(torch.nn.Linear(1, 1)))[1], unwrap(torch.nn.Linear(1, 1))]
    imported = sorted(name for name in ("torch._dynamo", "torch.distributed.fsdp") if name in sys.modules)
    print(json.dumps({"found": found, "imported": imported}))
""")


@pytest.fixture(scope="module", autouse=True)
def fresh() -> subprocess.Popen:
    """A fresh interpreter recognising wrappers, started first and read last (it imports torch meanwhile)."""
    child = subprocess.Popen([sys.executable, "-c", FRESH], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate()


def test_fsdp_sharded_over_two_ranks_is_refused_and_unsharded_fsdp_comes_back(two_ranks):
    expected = {
        "FULL_SHARD True": SHARDED, "FULL_SHARD False": SHARDED,  # the shard is said first
        "SHARD_GRAD_OP True": SHARDED, "SHARD_GRAD_OP False": SHARDED,
        "NO_SHARD True": [True, "FullyShardedDataParallel", 2], "NO_SHARD False": FLATTENED,
    }
    assert two_ranks == [expected, expected]


def test_recognising_a_wrapper_imports_neither_fsdp_nor_dynamo(fresh):
    out, err = fresh.communicate(timeout=60)
    assert fresh.returncode == 0, err[-2000:]
    assert json.loads(out) == {"found": ["DataParallel", None], "imported": []}
