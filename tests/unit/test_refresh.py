"""writes/refresh.py's views and collectives, in a real user + mount namespace.

A child process (``unshare`` needs a single thread, so not pytest's) mounts the overlay over a repository
and looks every path up; this process, outside the namespace, is rank 0 and changes them; the child then
refreshes (by hand, or by returning from a collective of a one-rank gloo group) and says what it sees.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent('''
    import json, os, sys
    from taas_magic.writes import namespace, refresh, shared

    repository, scratch, how = sys.argv[1:4]
    os.chdir(repository)
    namespace.divert_writes(repository, scratch)
    if how != "collective":
        views = refresh.Views(repository, scratch)
        views.beneath = how != "on-top"  # on top: as on a kernel before 6.5
    shared.share(os.path.join(repository, "parts"))
    os.chdir("sub")

    def look():
        seen = {}
        for path in ("../new.txt", "../target.txt", "../gone.txt", "../newdir", ".", "../mine.txt"):
            if not os.path.exists(path):
                seen[path] = None
            elif os.path.isdir(path):
                seen[path] = sorted(os.listdir(path))
            else:
                seen[path] = open(path).read()
        return seen

    look()
    with open("../mine.txt", "w") as f:
        f.write("rank 1's own")
    print("looked", flush=True)
    sys.stdin.readline()  # rank 0 changes the repository now
    if how == "collective":
        import torch.distributed as dist
        refresh.follow_collectives(dist)
        dist.init_process_group("gloo", init_method="file://" + os.path.join(scratch, "store"), rank=0, world_size=1)
        dist.barrier()
        views = refresh._views
    else:
        for _ in range(3):
            views.switch()
    views.ready.wait()  # the next view made
    views.old.join()  # the old ones dropped
    with open("../parts/__1_0.distcp", "w") as f:  # a collective checkpoint's folder: still written in place
        f.write("part")
    with open("a", "w") as f:  # a file of the repository changed: copied up into the layer, by the view in use
        f.write("rank 1's a")
    assert open("a").read() == "rank 1's a"
    with open("/proc/self/mountinfo") as f:
        overlays = sum(" overlay " in line for line in f)
    print(json.dumps({"seen": look(), "cwd": os.getcwd(), "overlays": overlays, "a": open("a").read()}), flush=True)
''')


def _overlay_allowed(tmp_path) -> bool:
    probe = subprocess.run([sys.executable, "-m", "taas_magic.writes.namespace", str(tmp_path), str(tmp_path / "probe")],
                           capture_output=True, text=True)
    return probe.returncode == 0


@pytest.mark.parametrize("how", ["beneath", "on-top", "collective"])
def test_a_refresh_shows_rank_0s_changes_keeps_the_ranks_own_and_its_shared_folders(tmp_path, how):
    if not _overlay_allowed(tmp_path):
        pytest.skip("this host forbids user namespaces or overlay mounts")
    repository, scratch = tmp_path / "repo", tmp_path / "scratch"
    (repository / "sub").mkdir(parents=True)
    scratch.mkdir()
    (repository / "target.txt").write_text("v1")
    (repository / "gone.txt").write_text("here")
    (repository / "sub" / "a").write_text("")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(repository), str(scratch), how], text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    with child:
        assert child.stdout.readline().strip() == "looked", child.stderr.read()
        (repository / "new.txt").write_text("new")  # rank 0's changes, made outside the namespace
        (repository / "target.tmp").write_text("v2")
        os.replace(repository / "target.tmp", repository / "target.txt")
        (repository / "gone.txt").unlink()
        (repository / "newdir").mkdir()
        (repository / "sub" / "b").write_text("")
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()
        assert line, child.stderr.read()
        said = json.loads(line)
        child.kill()
    assert said["seen"] == {"../new.txt": "new", "../target.txt": "v2", "../gone.txt": None, "../newdir": [],
                            ".": ["a", "b"], "../mine.txt": "rank 1's own"}
    assert said["a"] == "rank 1's a"
    assert said["cwd"] == str(repository / "sub")
    assert not (repository / "mine.txt").exists()  # its own writes stayed in its layer
    assert (repository / "sub" / "a").read_text() == ""
    assert (repository / "parts" / "__1_0.distcp").read_text() == "part"  # the shared folder, bound again
    # Beneath, the old views go: the one in use is left, and the next one, ready. On top, the old ones stay below
    # (the fallback's cost).
    assert said["overlays"] == (5 if how == "on-top" else 2)
