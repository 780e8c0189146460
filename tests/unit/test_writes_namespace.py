"""writes/namespace.py: a rank's user + mount namespace with the overlay over the repository, for real.

``unshare(CLONE_NEWUSER)`` needs a process with one thread, and the mounts must never reach this
process's own namespace, so each test starts a real interpreter (a "rank") that enters the namespaces,
mounts the overlay over a repository under ``tmp_path``, writes as a cell would (Python, and a shell it
starts) and prints what it saw as JSON; the test, outside the namespace, then checks the repository,
the scratch layer and its own mount table. Skipped where the host forbids user namespaces or overlays
(the kernel's own probe says so).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from taas_magic.writes.namespace import mount_view, scratch_dir
from tests.unit.rankside import said_by

PROLOGUE = """
import json, os, subprocess, sys, threading
from taas_magic.writes import namespace, shared
repo, scratch = sys.argv[1], sys.argv[2]
said = {}
"""


def _rank(repo, scratch, code: str) -> dict:
    return said_by(PROLOGUE, code, str(repo), str(scratch), timeout=60)


def _probe(repo, scratch) -> subprocess.CompletedProcess:
    """The kernel's probe, as writes/rule.py starts it."""
    return subprocess.run([sys.executable, "-m", "taas_magic.writes.namespace", str(repo), str(scratch)],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture()
def repo(tmp_path):
    if _probe(tmp_path, tmp_path / "probe").returncode != 0:
        pytest.skip("this host forbids user namespaces or overlay mounts")
    root = tmp_path / "repo"
    (root / "data").mkdir(parents=True)
    (root / "a.txt").write_text("v1")
    (root / "data" / "x").write_text("x")
    return root


def test_a_process_that_mounted_no_overlay_has_no_scratch_and_no_view_to_mount_again(tmp_path):
    """pytest's own process, as rank 0 or a rank under the Python fallback: nothing to follow, nothing mounted."""
    assert scratch_dir() is None
    with pytest.raises(AssertionError, match="mount_overlay first"):
        mount_view(str(tmp_path))
    assert not os.path.exists(tmp_path / "work-1")


def _overlays_here() -> list[str]:
    with open("/proc/self/mountinfo") as mounts:
        return [line for line in mounts if " overlay " in line]


def test_every_write_of_the_rank_and_of_what_it_starts_lands_in_its_scratch_and_the_repository_is_untouched(repo, tmp_path):
    scratch = tmp_path / "scratch"
    before = _overlays_here()
    said = _rank(repo, scratch, """
        os.chdir(repo)
        said["before"] = namespace.scratch_dir()
        uid, gid = os.getuid(), os.getgid()
        namespace.divert_writes(repo, scratch)
        said["after"] = namespace.scratch_dir()
        said["same_identity"] = (os.getuid(), os.getgid()) == (uid, gid)
        said["cwd"] = [os.getcwd(), open("a.txt").read()]  # the working directory entered again, in the overlay
        with open("a.txt", "a") as f:
            f.write("+rank1")
        with open("data/new.bin", "wb") as f:
            f.write(b"new")
        subprocess.run(["sh", "-c", "echo shell > from-shell.txt && rm data/x && mkdir made && chmod 600 a.txt"],
                       check=True)
        said["seen"] = [open("a.txt").read(), sorted(os.listdir(".")), sorted(os.listdir("data")),
                        open("from-shell.txt").read(), oct(os.stat("a.txt").st_mode & 0o777)]
    """)
    assert said == {"before": None, "after": str(scratch), "same_identity": True, "cwd": [str(repo), "v1"],
                    "seen": ["v1+rank1", ["a.txt", "data", "from-shell.txt", "made"], ["new.bin"], "shell\n", "0o600"]}
    assert sorted(os.listdir(repo)) == ["a.txt", "data"] and sorted(os.listdir(repo / "data")) == ["x"]
    assert (repo / "a.txt").read_text() == "v1" and (repo / "data" / "x").read_text() == "x"
    upper = scratch / "upper"
    assert (upper / "a.txt").read_text() == "v1+rank1" and (upper / "from-shell.txt").read_text() == "shell\n"
    assert (upper / "data" / "new.bin").read_bytes() == b"new" and (upper / "made").is_dir()
    assert _overlays_here() == before  # the rank's mounts never reached this namespace


def test_a_process_with_a_thread_is_refused_the_namespaces_with_the_reason(repo, tmp_path):
    said = _rank(repo, tmp_path / "scratch", """
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        try:
            namespace.enter_namespace()
        except namespace.IsolationUnavailable as exc:
            said["refused"] = [isinstance(exc, OSError), exc.errno, str(exc)]
        stop.set()
    """)
    assert said == {"refused": [True, 22, "[Errno 22] unshare(CLONE_NEWUSER|CLONE_NEWNS): Invalid argument"]}


def test_a_spare_enters_its_namespaces_first_and_mounts_the_overlay_later_from_any_thread(repo, tmp_path):
    """A GPU spare's order (launch/local/spares.py): namespaces before CUDA's threads, the overlay when a cell takes it."""
    scratch = tmp_path / "scratch"
    said = _rank(repo, scratch, """
        namespace.enter_namespace()
        with open("/proc/self/uid_map") as f:
            said["uid_map"] = f.read().split()
        said["scratch_before_mount"] = namespace.scratch_dir()
        errors = []
        def mount():
            try:
                namespace.divert_writes(repo, scratch, in_namespace=True)
            except Exception as exc:
                errors.append(repr(exc))
        thread = threading.Thread(target=mount)
        thread.start(); thread.join()
        with open(os.path.join(repo, "later.txt"), "w") as f:
            f.write("later")
        said["errors"] = errors
        said["scratch"] = namespace.scratch_dir()
    """)
    uid = str(os.getuid())
    assert said == {"uid_map": [uid, uid, "1"], "scratch_before_mount": None, "errors": [], "scratch": str(scratch)}
    assert not (repo / "later.txt").exists() and (scratch / "upper" / "later.txt").read_text() == "later"


# A folder overlayfs refuses as a lower layer (procfs): the mount itself is refused, as on a host that forbids it.
REFUSED = "/proc/self/fdinfo"


def test_a_refused_overlay_says_why_and_leaves_nothing_kept(repo, tmp_path):
    said = _rank(repo, tmp_path / "scratch", f"""
        namespace.enter_namespace()
        try:
            namespace.mount_overlay({REFUSED!r}, scratch)
        except namespace.IsolationUnavailable as exc:
            said["refused"] = str(exc)
        said["kept"] = [shared.repository(), namespace.scratch_dir()]
    """)
    assert said == {"refused": "[Errno 22] overlay mount: Invalid argument", "kept": [None, None]}


def test_the_kernels_probe_exits_0_where_allowed_and_prints_the_reason_where_not(repo, tmp_path):
    allowed = _probe(repo, tmp_path / "scratch")
    assert (allowed.returncode, allowed.stdout) == (0, "")
    assert (repo / "a.txt").read_text() == "v1"
    refused = _probe(REFUSED, tmp_path / "scratch2")
    assert (refused.returncode, refused.stdout.strip()) == (1, "[Errno 22] overlay mount: Invalid argument")
    missing = _probe(tmp_path / "missing", tmp_path / "scratch3")
    assert missing.returncode == 1 and missing.stdout.startswith("[Errno 2] No such file or directory")


def test_a_view_mounted_again_shows_the_repository_with_the_ranks_own_writes_each_with_its_own_work_folder(repo, tmp_path):
    scratch = tmp_path / "scratch"
    said = _rank(repo, scratch, """
        namespace.divert_writes(repo, scratch)
        with open(os.path.join(repo, "mine.txt"), "w") as f:
            f.write("mine")
        works = []
        for name in ("view1", "view2"):
            target = os.path.join(scratch, name)
            os.makedirs(target)
            works.append(namespace.mount_view(target))
            said[name] = [sorted(os.listdir(target)), open(os.path.join(target, "mine.txt")).read()]
        with open(os.path.join(scratch, "view1", "through-view.txt"), "w") as f:  # the same upper layer
            f.write("v")
        said["in_repo_view"] = os.path.exists(os.path.join(repo, "through-view.txt"))
        said["works"] = works
    """)
    assert said["view1"] == said["view2"] == [["a.txt", "data", "mine.txt"], "mine"]
    assert said["works"] == [str(scratch / "work-1"), str(scratch / "work-2")]
    assert said["in_repo_view"] is True
    assert not (repo / "mine.txt").exists() and not (repo / "through-view.txt").exists()

