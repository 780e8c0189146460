"""writes/refresh.py beyond the views themselves (tests/unit/test_refresh.py): who pays, how collectives are
wrapped, a refresh the host refuses, and a rank whose working folder rank 0 removed.

Where this process's view is no overlay (pytest's own, as rank 0's), :func:`refresh` and
:func:`follow_collectives` must do nothing: that is checked here, in-process, on the real
``torch.distributed``. Everything with an overlay runs in a real interpreter (a rank) that mounts it in a
user + mount namespace of its own and prints what it saw as JSON; this process plays rank 0, outside.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

import taas_magic.writes.refresh
from taas_magic.writes import namespace
from taas_magic.writes.refresh import COLLECTIVES, follow_collectives

PROLOGUE = """
import json, os, sys
from taas_magic.writes import namespace, refresh
repo, scratch = sys.argv[1], sys.argv[2]
os.chdir(repo)
namespace.divert_writes(repo, scratch)
said = {}
"""


def _start(repo, scratch, code: str) -> subprocess.Popen:
    script = PROLOGUE + textwrap.dedent(code) + "\nprint(json.dumps(said), flush=True)\n"
    return subprocess.Popen([sys.executable, "-c", script, str(repo), str(scratch)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})


def _rank(repo, scratch, code: str) -> tuple[dict, str]:
    """Run ``code`` in a rank with the overlay mounted; what it put in ``said``, and its stderr."""
    with _start(repo, scratch, code) as child:
        out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    return json.loads(out.splitlines()[-1]), err


@pytest.fixture()
def repo(tmp_path):
    probe = subprocess.run([sys.executable, "-m", "taas_magic.writes.namespace", str(tmp_path), str(tmp_path / "probe")],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("this host forbids user namespaces or overlay mounts")
    root = tmp_path / "repo"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("v1")
    return root


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_where_the_view_is_no_overlay_nothing_is_wrapped_and_a_refresh_does_nothing():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    assert namespace.scratch_dir() is None  # pytest's own process: as rank 0, or the Python fallback
    before = {name: (getattr(dist, name, None), getattr(c10d, name, None)) for name in COLLECTIVES}
    threads = threading.active_count()
    follow_collectives(dist)
    taas_magic.writes.refresh.refresh()
    assert {name: (getattr(dist, name, None), getattr(c10d, name, None)) for name in COLLECTIVES} == before
    assert taas_magic.writes.refresh._views is None and threading.active_count() == threads


def test_every_collective_is_wrapped_once_in_both_modules_and_returns_what_it_returned_after_a_refresh(repo, tmp_path):
    said, err = _rank(repo, tmp_path / "scratch", """
        import torch, torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        originals = {name: getattr(dist, name) for name in refresh.COLLECTIVES if hasattr(dist, name)}
        refresh.follow_collectives(dist)
        wrapped = {name: getattr(dist, name) for name in originals}
        refresh.follow_collectives(dist)  # a second cell's import: nothing wrapped twice
        said["every_one"] = all(w is not originals[n] and w.__wrapped__ is originals[n] for n, w in wrapped.items())
        said["named"] = sorted(n for n, w in wrapped.items() if w.__name__ != n)
        said["twice"] = [n for n, w in wrapped.items() if getattr(dist, n) is not w]
        said["c10d_same"] = [n for n in originals if hasattr(c10d, n) and getattr(c10d, n) is not getattr(dist, n)]
        said["missing"] = sorted(set(refresh.COLLECTIVES) - set(originals))
        said["views_before"] = refresh._views is not None
        dist.init_process_group("gloo", init_method="file://" + os.path.join(scratch, "store"), rank=0, world_size=1)
        objects = [None]
        if dist.get_rank() == 0:
            objects = [{"from": "rank 0"}]
        said["broadcast"] = [dist.broadcast_object_list(objects, src=0), objects]
        tensor = torch.ones(2)
        work = dist.all_reduce(tensor, async_op=True)
        work.wait()
        said["all_reduce"] = [type(work).__name__, tensor.tolist()]
        said["views_after"] = refresh._views is not None
        dist.destroy_process_group()
    """)
    assert said == {"every_one": True, "named": [], "twice": [], "c10d_same": [], "missing": [],
                    "views_before": False, "broadcast": [None, [{"from": "rank 0"}]],
                    "all_reduce": [said["all_reduce"][0], [1.0, 1.0]], "views_after": True}
    assert said["all_reduce"][0] != "NoneType"  # async_op's Work handed back through the wrapper
    assert "taas:" not in err


def test_a_rank_whose_folder_rank_0_removed_stands_in_the_repository_after_the_refresh(repo, tmp_path):
    with _start(repo, tmp_path / "scratch", """
        os.chdir("sub")
        os.listdir(".")
        print("standing", flush=True)
        sys.stdin.readline()
        refresh.refresh()
        said["cwd"] = os.getcwd()
        said["seen"] = [os.path.exists(os.path.join(repo, "sub")), open(os.path.join(repo, "b.txt")).read()]
    """) as child:
        assert child.stdout.readline().strip() == "standing", child.stderr.read()
        os.rmdir(repo / "sub")  # rank 0 removes it and writes another file
        (repo / "b.txt").write_text("rank 0's")
        out, err = child.communicate("go\n", timeout=60)
    assert child.returncode == 0, err
    assert json.loads(out.splitlines()[-1]) == {"cwd": str(repo), "seen": [False, "rank 0's"]}


def test_a_refresh_the_host_refuses_is_said_once_and_the_rank_goes_on_with_its_view(repo, tmp_path):
    scratch = tmp_path / "scratch"
    said, err = _rank(repo, scratch, """
        open(os.path.join(scratch, "next-view"), "w").close()  # where the next view would be made: refused
        refresh.refresh()
        refresh.refresh()  # not tried again, not said again
        with open("mine.txt", "w") as f:
            f.write("still diverted")
        said["seen"] = [open("a.txt").read(), open("mine.txt").read()]
    """)
    assert said == {"seen": ["v1", "still diverted"]}
    lines = [line for line in err.splitlines() if line.startswith("taas:")]
    assert len(lines) == 1, err
    assert lines[0].startswith("taas: this rank's view of the repository can no longer follow rank 0's writes (")
    assert "File exists" in lines[0] and lines[0].endswith("what rank 0 writes from now on may not be seen here")
    assert not (repo / "mine.txt").exists()
