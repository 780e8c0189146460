"""A rank's device (taas_magic/rank/devices.py): on a host without GPUs a cell's ``backend="nccl"`` (by keyword or
position, alone or in a per-device list) reaches torch as gloo, in ``init_process_group`` and ``new_group`` of both
``torch.distributed`` and its ``distributed_c10d``, wrapped once however often it is asked; every other backend and
argument passes through untouched. On a GPU host, ``bind_gpu`` makes LOCAL_RANK's GPU the current one.

What each wrapper passes on is read on a stand-in module whose functions record their arguments; then two real rank
processes wrap the real ``torch.distributed`` and make a real two-rank group with ``backend="nccl"`` on this CPU
machine, all-reduce in it and in a ``new_group(backend="nccl")``. (Wrapping the real module changes it for the whole
process: only children do that.)"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from taas_magic.rank.devices import serve_nccl_with_gloo
from tests.unit.rankside import ROOT, WAIT


def stand_in() -> tuple[types.ModuleType, list]:
    """A ``torch.distributed`` whose four functions record (where, args, kwargs), as torch names them."""
    calls: list = []

    def recorder(where: str, name: str):
        def function(*args, **kwargs):
            calls.append((where, args, kwargs))
            return where

        function.__name__ = function.__qualname__ = name
        return function

    c10d = types.SimpleNamespace(init_process_group=recorder("c10d.init", "init_process_group"),
                                 new_group=recorder("c10d.new_group", "new_group"))
    dist = types.ModuleType("torch.distributed")
    dist.distributed_c10d = c10d
    dist.init_process_group = recorder("dist.init", "init_process_group")
    dist.new_group = recorder("dist.new_group", "new_group")
    return dist, calls


@pytest.mark.parametrize(("asked", "given"), [
    ("nccl", "gloo"),
    ("NCCL", "gloo"),
    ("cuda:nccl", "gloo"),
    ("cuda:nccl,cpu:gloo", "cpu:gloo"),
    ("cpu:gloo,cuda:nccl", "cpu:gloo"),
    ("gloo", "gloo"),
    ("mpi", "mpi"),
    (None, None),
])
def test_a_backend_by_keyword_reaches_torch_with_nccl_served_by_gloo(asked, given):
    dist, calls = stand_in()
    serve_nccl_with_gloo(dist)
    assert dist.init_process_group(backend=asked, rank=0) == "dist.init"
    assert dist.distributed_c10d.init_process_group(backend=asked) == "c10d.init"
    assert dist.new_group([0, 1], backend=asked) == "dist.new_group"
    assert dist.distributed_c10d.new_group(ranks=[0], backend=asked) == "c10d.new_group"
    assert calls == [("dist.init", (), {"backend": given, "rank": 0}), ("c10d.init", (), {"backend": given}),
                     ("dist.new_group", ([0, 1],), {"backend": given}), ("c10d.new_group", (), {"ranks": [0], "backend": given})]


def test_torchs_backend_enum_is_served_by_gloo_too():
    torch_dist = pytest.importorskip("torch.distributed")
    dist, calls = stand_in()
    serve_nccl_with_gloo(dist)
    dist.init_process_group(torch_dist.Backend.NCCL)
    assert calls == [("dist.init", ("gloo",), {})]


def test_init_process_groups_first_argument_is_its_backend_but_new_groups_is_its_ranks():
    dist, calls = stand_in()
    serve_nccl_with_gloo(dist)
    dist.init_process_group("nccl", "env://", world_size=2)
    dist.distributed_c10d.init_process_group("cuda:nccl,cpu:gloo")
    dist.new_group([0, 1])
    dist.new_group([0], 60)
    assert calls == [("dist.init", ("gloo", "env://"), {"world_size": 2}), ("c10d.init", ("cpu:gloo",), {}),
                     ("dist.new_group", ([0, 1],), {}), ("dist.new_group", ([0], 60), {})]


def test_without_a_backend_torch_chooses_as_it_would():
    dist, calls = stand_in()
    serve_nccl_with_gloo(dist)
    dist.init_process_group(init_method="env://")
    dist.new_group()
    assert calls == [("dist.init", (), {"init_method": "env://"}), ("dist.new_group", (), {})]


def test_serving_twice_wraps_once_and_the_wrappers_keep_torchs_names():
    dist, calls = stand_in()
    original = dist.init_process_group
    serve_nccl_with_gloo(dist)
    wrapped = dist.init_process_group
    serve_nccl_with_gloo(dist)
    assert dist.init_process_group is wrapped and wrapped.__wrapped__ is original
    assert wrapped.__name__ == "init_process_group" and dist.new_group.__name__ == "new_group"
    dist.init_process_group("nccl")
    assert calls == [("dist.init", ("gloo",), {})]  # translated, and the original called once


def test_a_module_without_new_group_is_served_for_what_it_has():
    dist, calls = stand_in()
    del dist.new_group
    del dist.distributed_c10d.new_group
    serve_nccl_with_gloo(dist)
    dist.init_process_group(backend="nccl")
    assert calls == [("dist.init", (), {"backend": "gloo"})] and not hasattr(dist, "new_group")


RANK = r'''
import os, sys
import torch, torch.distributed as dist
from taas_magic.rank.devices import serve_nccl_with_gloo
serve_nccl_with_gloo(dist)
rank = int(os.environ["RANK"])
dist.init_process_group("nccl", init_method="file://" + sys.argv[1], rank=rank, world_size=2)
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
group = dist.new_group([0, 1], backend="nccl")
mine = torch.tensor([10.0 * (rank + 1)])
dist.all_reduce(mine, group=group)
print(dist.get_backend(), dist.get_backend(group), total.item(), mine.item(), flush=True)
dist.destroy_process_group()
'''


def test_two_real_ranks_asking_for_nccl_on_this_cpu_machine_make_a_gloo_group_and_reduce_in_it(tmp_path):
    children = []
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": ""}
            children.append(subprocess.Popen([sys.executable, "-c", RANK, str(tmp_path / "store")], cwd=ROOT, env=env,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        ran = [child.communicate(timeout=WAIT * 2) for child in children]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.communicate()
    for child, (out, err) in zip(children, ran):
        assert child.returncode == 0, out + err
        assert out == "gloo gloo 3.0 30.0\n"


@pytest.mark.gpu
def test_bind_gpu_makes_the_local_ranks_gpu_the_current_one():
    """Needs two GPUs: LOCAL_RANK 1's GPU is not the default one, so binding it is seen."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    script = ("from taas_magic.rank.devices import bind_gpu\nimport torch\nbind_gpu()\n"
              "print(torch.cuda.current_device(), torch.ones(1, device='cuda').device)")
    ran = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "LOCAL_RANK": "1"},
                         capture_output=True, text=True, timeout=WAIT * 2)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "1 cuda:1\n"
