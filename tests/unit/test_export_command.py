"""``%taas export PATH [In[N]]`` (taas_magic/export/command.py) on a real IPython shell: which cell, prepared as a run
of it is (cell/prepared.py), and each refusal one line that writes nothing. (The job it writes, run: tests/kernel/
test_export.py.)"""

from __future__ import annotations

import os

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from taas_magic.errors import LaunchError
from taas_magic.export.command import export
from taas_magic.export.job import job_folder

SESSION = {"cache_ram": "", "ahead": 16, "timeout": None, "hang": 30.0, "place_timeout": 60.0, "restarts": 1,
           "output": "rank0", "keep": False}


@pytest.fixture
def shell(tmp_path, monkeypatch):
    """The shell, its history as ``cells`` (In[1], In[2], ...; the last one the export line), its namespace theirs."""
    shell = InteractiveShell.instance()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    history = shell.history_manager.input_hist_raw
    saved, names = list(history), dict(shell.user_ns)

    def ran(*cells: str) -> None:
        history[:] = ["", *cells]
        for cell in cells:
            if not cell.startswith(("%", "#pragma")):
                exec(cell, shell.user_ns)

    shell.ran = ran
    yield shell
    history[:] = saved
    shell.user_ns.clear()
    shell.user_ns.update(names)


def test_the_last_taas_cell_is_written_with_its_settings_and_what_it_reads(shell, tmp_path, capsys):
    shell.ran("scale = 3", "def grow(x):\n    return x * scale", "#pragma taas --gpus 2 --device cpu\nw = grow(2)",
              "print('after')", "%taas export jobs/train.py")
    capsys.readouterr()
    export(shell, SESSION, "jobs/train.py")
    script = (tmp_path / "jobs" / "train.py").read_text()
    assert "ranks=2, device='cpu', restarts=1, timeout=None" in script  # the session's --restarts, the pragma's --gpus
    assert "def grow(x):" in script and "scale, = _taas.values('scale')" in script and "w = grow(2)" in script
    assert "print('after')" not in script
    said = capsys.readouterr().out
    assert said.startswith("taas: In[3] exported as train.py (2 rank(s) on cpu") and said.count("\n") == 1
    assert sorted(os.listdir(tmp_path / "jobs")) == ["train.py", "train.sbatch", "train.taas", "train_ray.py"]


def test_a_magic_cell_and_a_named_cell_are_exported_as_the_magic_would_run_them(shell, tmp_path):
    shell.ran("%%taas --gpus 3 --device cpu\nfirst = 1", "#pragma taas --gpus 2 --device cpu\nsecond = 2",
              "%taas export a.py In[1]")
    export(shell, SESSION, "a.py In[1]")
    script = (tmp_path / "a.py").read_text()
    assert "ranks=3, device='cpu'" in script and "first = 1" in script and "second = 2" not in script


@pytest.mark.parametrize(("cells", "argument", "why"), [
    (["x = 1", "%taas export j.py"], "j.py", "no taas cell has run in this session yet"),
    (["#pragma taas --gpus 2 --device cpu\ny = 1", "%taas export j.txt"], "j.txt", "must end in .py"),
    (["#pragma taas --gpus 2 --device cpu\ny = 1", "%taas export"], "", "%taas export PATH"),
    (["x = 1", "#pragma taas --gpus 2 --device cpu\ny = 1", "%taas export j.py In[1]"], "j.py In[1]",
     "In[1] is not a taas cell"),
    (["#pragma taas --gpus 2 --device cpu\ny = 1", "%taas export j.py In[x]"], "j.py In[x]", "which cell: In[N]"),
    (["#pragma taas --gpus 2 --device cpu --trials 2\ny = 1", "%taas export j.py"], "j.py", "is a search"),
    (["#pragma taas --gpus 2 --device cpu\n!ls\ny = 1", "%taas export j.py"], "j.py", "uses IPython"),
    (["steps = (n for n in range(3))", "#pragma taas --gpus 2 --device cpu\nfirst = next(steps)",
      "%taas export j.py"], "j.py", "steps"),
], ids=["no-taas-cell", "not-py", "no-path", "not-taas", "bad-cell", "search", "ipython-syntax", "cannot-go"])
def test_each_refusal_is_one_line_and_writes_nothing(shell, tmp_path, cells, argument, why):
    shell.ran(*cells)
    with pytest.raises((UsageError, LaunchError), match=why.replace("[", r"\[").replace("]", r"\]")) as raised:
        export(shell, SESSION, argument)
    assert "\n" not in str(raised.value)
    assert not os.path.exists(tmp_path / "j.py") and not os.path.exists(job_folder(str(tmp_path / "j.py")))
