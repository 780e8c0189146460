"""kernel/runs/background.py's Runs: a bounded history, and a run that lets go of what it held."""

from __future__ import annotations

from taas_magic.kernel.runs.background import KEEP_ENDED, Runs, RunThread
from taas_magic.output.runlog import RunLog


class Work(RunThread):
    """A run whose work returns a value (or raises), holding a big object until it lets go."""

    def __init__(self, run_id: str, tmp_path, fail: bool = False):
        super().__init__(RunLog(run_id, directory=str(tmp_path)), run_id, 1, False, detached=False)
        self.held: object | None = bytearray(1 << 20)
        self.fail = fail

    def _work(self):
        self.log.end("failed" if self.fail else "ok")
        if self.fail:
            raise ValueError("on purpose")
        return "value"

    def _bind(self, namespace: dict):
        namespace["bound"] = self.outcome
        return self.outcome

    def _let_go_of_parts(self) -> None:
        self.held = None


def _ended(run: Work) -> Work:
    run.start()
    assert run.join(60)
    return run


def test_runs_keep_every_untaken_run_and_only_the_last_taken_ones(tmp_path):
    runs = Runs()
    untaken = runs.add(_ended(Work("untaken", tmp_path)))
    for index in range(KEEP_ENDED + 5):
        run = runs.add(_ended(Work(f"r{index}", tmp_path)))
        run.take({})
    runs.add(_ended(Work("last", tmp_path)))  # forgetting happens as runs are added
    ids = [run.id for run in runs.all()]
    assert untaken.id in ids and "r0" not in ids and f"r{KEEP_ENDED + 4}" in ids
    assert len(ids) == KEEP_ENDED + 2


def test_a_run_lets_go_when_taken_and_a_failed_one_as_it_ends(tmp_path):
    ok = _ended(Work("ok", tmp_path))
    assert ok.held is not None  # its results still to be bound
    namespace: dict = {}
    assert ok.take(namespace) == "value" and namespace == {"bound": "value"}
    assert ok.held is None and ok.outcome is None and [entry.kind for entry in ok.log.since(-1)[1]] == ["end"]
    failed = _ended(Work("failed", tmp_path, fail=True))
    assert failed.held is None  # nothing will be bound: let go at once, the error kept to be raised
    assert isinstance(failed.error, ValueError)
    frames = []
    traceback = failed.error.__traceback__
    while traceback is not None:
        frames.append(traceback.tb_frame)
        traceback = traceback.tb_next
    # the frames below the one that caught it (the run's own: what it held) keep no locals
    assert frames[0].f_code.co_name == "_main" and frames[1:] and all(not frame.f_locals for frame in frames[1:])
