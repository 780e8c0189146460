"""An exported job's runtime (taas_magic/export/job.py) launched as ``python SCRIPT``, in real processes, through torch's
own elastic launcher: every rank started with torchrun's environment, all of them started again after a failure up
to ``restarts`` times, all of them stopped at ``timeout``, and nothing left running."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psutil

HEAD = "from taas_magic.export import job as _taas_job\n_taas = _taas_job.start(__file__, ranks=2, device='cpu', {options})\n"


def run_script(tmp_path, body: str, **options: object) -> subprocess.CompletedProcess:
    """``body`` as a job of 2 CPU ranks started with ``options`` (restarts, timeout), run as ``python SCRIPT``."""
    script = tmp_path / "job.py"
    script.write_text(HEAD.format(options=", ".join(f"{k}={v!r}" for k, v in options.items())) + textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_a_failed_attempt_starts_every_rank_again_up_to_the_restarts(tmp_path):
    ran = run_script(tmp_path, """
        import os
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "attempt", attempt, flush=True)
        if attempt == 0 and os.environ["RANK"] == "1":
            raise SystemExit(3)
        """, restarts=1)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "failed (exitcode: 3) local_rank: 1" in ran.stderr  # torch's elastic agent says it, and restarts every rank
    assert "rank 0 of 2 attempt 0" in ran.stdout and "rank 0 of 2 attempt 1" in ran.stdout  # rank 0's output here
    logs = sorted((tmp_path / "job.taas" / "logs").glob("*/attempt_*/1/stdout.log"))  # rank 1's: torch's layout
    assert [log.parent.parent.name for log in logs] == ["attempt_0", "attempt_1"]
    assert "rank 1 of 2 attempt 1" in logs[1].read_text()


def test_without_restarts_a_failure_is_the_jobs_exit_status(tmp_path):
    ran = run_script(tmp_path, "import os\nif os.environ['RANK'] == '1':\n    raise SystemExit(5)\n")
    assert ran.returncode == 5


def test_a_timeout_stops_every_rank_and_leaves_none(tmp_path):
    ran = run_script(tmp_path, "import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(600)\n", timeout=3)
    assert ran.returncode == 124
    assert "the job ran past its --timeout 3 s: stopped" in ran.stderr
    pid = int(ran.stdout.split("pid ")[1].split()[0])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
