"""writes/unseen.py: a host that does not see the repository names its files, and reading one it lacks says why.

The audit hook is process-wide and stays, so what a rank does runs in a real interpreter of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from taas_magic.writes import unseen


def test_names_lists_files_shallowest_first_without_hidden_folders_or_caches(tmp_path):
    for relative, data in {"a.py": b"12", "deep/er/c.pt": b"1234", "b/x.txt": b"", ".git/HEAD": b"ref",
                           ".taas/checkpoints/r/1": b"x", "b/.venv/bin/python": b"elf", "b/.hidden.pt": b"pt",
                           "b/__pycache__/a.pyc": b"pyc"}.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_bytes(data)
    os.symlink("a.py", tmp_path / "link.py")
    assert unseen.names(str(tmp_path)) == (("a.py", 2), ("b/.hidden.pt", 2), ("b/x.txt", 0), ("deep/er/c.pt", 4))
    assert unseen.names(str(tmp_path), limit=2) == (("a.py", 2), ("b/.hidden.pt", 2))


RANK = """
import os, sys
from taas_magic.writes import unseen
view, upper = sys.argv[1], sys.argv[2]
unseen.enter(view, upper)
listed = (("code.py", 5), ("ckpt/resume.pt", 100), ("changed.txt", 5), ("gone.txt", 1), ("moved.txt", 2))
unseen.mark(listed)
assert open(os.path.join(view, "code.py")).read() == "same!"  # the host's copy, the same size: read as it is
assert os.path.exists("ckpt/resume.pt") and os.path.getsize("ckpt/resume.pt") == 100  # the same branch as rank 0's
for name in ("ckpt/resume.pt", "changed.txt"):
    try:
        try:
            open(name, "rb")
        except OSError:
            raise AssertionError("taken for a missing file")
    except unseen.UnseenFileError as error:
        print(name, "|", error)
    else:
        raise AssertionError(name + " was read")
assert unseen.placeholder("ckpt/resume.pt")
with open("ckpt/resume.pt", "wb") as file:  # written anew: the rank's own from now on
    file.write(b"mine")
assert open("ckpt/resume.pt", "rb").read() == b"mine" and not unseen.placeholder("ckpt/resume.pt")
open("new.txt", "w").write("hello")
os.replace("new.txt", "changed.txt")  # the atomic save onto a placeholder
assert open("changed.txt").read() == "hello"
os.remove("gone.txt")
assert not unseen.placeholder("gone.txt")
os.rename("moved.txt", "there.txt")  # a placeholder moved is one still
try:
    open("there.txt")
except unseen.UnseenFileError:
    pass
else:
    raise AssertionError("a moved placeholder was read")
unseen.mark(listed)  # the next cell: what the rank wrote is its own no longer where rank 0's differs
assert unseen.placeholder("ckpt/resume.pt") and unseen.placeholder("gone.txt")  # 4 bytes, not 100; removed here only
assert not unseen.placeholder("changed.txt")  # written here at the repository's size: taken to be the same
print("ok")
"""


def test_a_rank_sees_the_names_it_lacks_and_reading_one_fails_with_one_line(tmp_path):
    view, upper = tmp_path / "view", tmp_path / "upper"
    view.mkdir()
    upper.mkdir()
    (view / "code.py").write_text("same!")
    (view / "changed.txt").write_text("old")  # the host's copy differs (3 bytes, the repository's 5)
    ran = subprocess.run([sys.executable, "-c", textwrap.dedent(RANK), str(view), str(upper)], cwd=view,
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout.endswith("ok\n"), ran.stdout + ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0].startswith("ckpt/resume.pt | ckpt/resume.pt cannot be read here: "), lines
    assert "this host does not see the notebook's repository" in lines[0], lines
    assert lines[1].startswith("changed.txt | changed.txt cannot be read here: "), lines
    assert (view / "code.py").read_text() == "same!"  # the host's own copy left as it was
