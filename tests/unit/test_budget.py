"""The cell's output budget: head lines shown, the middle in a log, the tail at the end."""

from taas_magic.output.budget import OutputBudget


def _run(monkeypatch, tmp_path, chunks, **limits):
    monkeypatch.setenv("TAAS_LOG_DIR", str(tmp_path))
    budget = OutputBudget("run1", **limits)
    shown = "".join(budget.admit(stream, text) for stream, text in chunks)
    end = budget.finish()
    return budget, shown, end


def test_under_the_limit_everything_is_shown_and_no_log_is_written(monkeypatch, tmp_path):
    budget, shown, end = _run(monkeypatch, tmp_path, [("stdout", "a\nb\n"), ("stdout", "c\n")], head_lines=3)
    assert shown == "a\nb\nc\n" and end == [] and list(tmp_path.iterdir()) == []


def test_past_the_limit_head_then_notice_and_tail_and_the_full_log(monkeypatch, tmp_path):
    lines = [f"line {i}\n" for i in range(100)]
    chunks = [("stdout", "".join(lines[i : i + 7])) for i in range(0, 100, 7)]
    budget, shown, end = _run(monkeypatch, tmp_path, chunks, head_lines=10, tail_lines=5)
    assert shown == "".join(lines[:10])  # cut at a line boundary inside a chunk
    assert end[0] == ("stdout", f"\n[taas] 85 lines elided, full log at {tmp_path}/run1.log\n")
    assert [text for _, text in end[1:]] == lines[-5:]
    assert (tmp_path / "run1.log").read_text() == "".join(lines)  # everything, head included, in order
    assert oct((tmp_path / "run1.log").stat().st_mode & 0o777) == "0o600"


def test_byte_limit_and_carriage_returns_count_only_finished_lines(monkeypatch, tmp_path):
    bar = "".join(f"{p}%\r" for p in range(100))  # a progress bar redrawing one line: no lines, no bytes
    budget, shown, end = _run(monkeypatch, tmp_path, [("stderr", bar), ("stdout", "x" * 50 + "\n"), ("stdout", "y" * 60 + "\n")],
                              head_bytes=100)
    assert shown == bar + "x" * 50 + "\n"
    assert end == [("stdout", "y" * 60 + "\n")]  # one line past the head: it is the tail, no notice
