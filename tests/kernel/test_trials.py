"""Many trials from one cell (--trials K), over a real kernel, real CPU ranks and real Optuna.

Each trial is a run of 2 gloo ranks; the search runs them one at a time here (a host without
GPUs) unless ``--parallel``. The shared kernel's cells use names of their own, and every test
checks that nothing a cell started is left (the ``kernel`` fixture).
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path

import pytest

pytest.importorskip("optuna")

SEARCH = ("#pragma taas --device cpu --gpus 2 --trials 4 {extra}\n"
          "import taas, torch.distributed as dist\n"
          "dist.init_process_group('gloo')\n"
          "t = taas.trial()\n"
          "lr = t.suggest_float('lr', 1e-3, 1.0, log=True)\n"
          "width = t.suggest_categorical('width', [4, 8, 16])\n"
          "both = [None, None]\n"
          "dist.all_gather_object(both, (t.number, lr, width))\n"
          "assert both[0] == both[1], both\n"
          "for step in range(4):\n"
          "    taas.report(step, loss=(lr - 0.1) ** 2 + 1.0 / width)\n"
          "print('trial', t.number, 'params', t.params, flush=True)\n"
          "{name} = both\n"
          "dist.destroy_process_group()\n"
          "lr\n")


def _display(ran, name: str) -> dict:
    """The search's display ``name`` (table, chart), as its last update left it."""
    shown = [m.content["data"] for m in ran.messages if m.type in ("display_data", "update_display_data")
             and m.content.get("transient", {}).get("display_id", "").startswith(f"taas-search-{name}-")]
    assert shown, [m.type for m in ran.messages]
    return shown[-1]


def _table_shows(shows):
    """For ``Kernel.wait_for``: the search's table (its text) shows what is wanted."""
    def arrived(kind: str, content: dict) -> bool:
        return kind in ("display_data", "update_display_data") and shows(content["data"]["text/plain"]) \
            and content.get("transient", {}).get("display_id", "").startswith("taas-search-table-")
    return arrived


def test_a_search_runs_every_trial_the_ranks_agree_and_the_best_trials_names_come_back(kernel):
    ran = kernel.execute(SEARCH.format(extra="", name="seen_by_ranks"), timeout=240)
    assert ran.reply["status"] == "ok", ran.error_text()
    trials = json.loads(kernel.execute(
        "import taas\nprint(taas.trials()[['number', 'value', 'state']].to_json(orient='records'))").stream())
    assert [row["number"] for row in trials] == [0, 1, 2, 3]
    assert all(row["state"] == "complete" for row in trials), trials
    best = min(trials, key=lambda row: row["value"])
    printed = ran.stream()
    assert f"taas: best trial {best['number']}: loss {best['value']:.6g}" in printed, printed
    # the best trial's rank-0 names and final value are the notebook's: both ranks saw the same params
    number, lr, width = json.loads(kernel.execute("import json\nprint(json.dumps(seen_by_ranks[0]))").stream())
    assert number == best["number"] and kernel.execute("seen_by_ranks[0] == seen_by_ranks[1]").result["text/plain"] == "True"
    assert float(ran.result["text/plain"]) == lr and abs((lr - 0.1) ** 2 + 1.0 / width - best["value"]) < 1e-9
    # taas.metrics() is the best trial's reports (not those of whichever trial ended last)
    reported = json.loads(kernel.execute("print(json.dumps(taas.metrics()))").stream())
    assert [row["step"] for row in reported] == [0, 1, 2, 3], reported
    assert all(abs(row["loss"] - best["value"]) < 1e-9 for row in reported), (reported, best)
    # a trial rank 0 bound comes back as the values it gave
    assert kernel.execute("t.number, t.params == {'lr': lr, 'width': width}").result["text/plain"] == f"({number}, True)"
    display = _display(ran, "table")
    assert "<table" in display["text/html"] and _display(ran, "chart")["image/svg+xml"].count("<polyline") == 4
    assert f"trial {number}'s last lines" in display["text/plain"]
    assert re.search(rf"^\*{number}\s+lr=", display["text/plain"], flags=re.MULTILINE), display["text/plain"]
    study = kernel.execute("s = taas.study()\nprint(len(s.trials), s.best_trial.number, s.direction.name)").stream()
    assert study.split() == ["4", str(number), "MINIMIZE"]
    each_log = kernel.execute("import os\nprint(all(os.stat(p).st_mode & 0o077 == 0 for p in taas.trials()['log']))").stream()
    assert each_log.strip() == "True"  # every trial's run log: owner-only


def test_a_failing_trial_is_recorded_and_the_search_goes_on(kernel):
    cell = ("#pragma taas --device cpu --gpus 2 --trials 3 --sampler grid --prune none --objective acc --maximize\n"
            "import taas\n"
            "bad_or_not = taas.trial().suggest_categorical('x', [1, 2, 3])\n"
            "if bad_or_not == 2:\n"
            "    raise ValueError('trial with x=2 is broken')\n"
            "taas.report(0, loss=0.0, acc=float(bad_or_not))\n"
            "grid_x = bad_or_not\n")
    ran = kernel.execute(cell, timeout=240)
    assert ran.reply["status"] == "ok", ran.error_text()
    assert "failed: " in ran.stream("stderr") and "x=2 is broken" in ran.stream("stderr"), ran.stream("stderr")
    assert "(its log: " in ran.stream("stderr") and "started" not in ran.stream()  # the table, not a line per trial
    states = json.loads(kernel.execute("import taas\nprint(taas.trials()[['params', 'state']].to_json(orient='records'))")
                        .stream())
    assert sorted((row["params"]["x"], row["state"]) for row in states) == [(1, "complete"), (2, "failed"), (3, "complete")]
    assert kernel.execute("grid_x").result["text/plain"] == "3"  # the best (highest acc) of the grid's three points
    assert "taas: best trial" in ran.stream() and "acc 3 · x=3" in ran.stream(), ran.stream()


def test_a_grid_whose_points_run_side_by_side_asks_each_point_once(kernel):
    # Optuna's GridSampler counts a point as used once its trial ended: asked while both points
    # still run, it would give a running point again (here: trials 3 and 4 of a 2-point grid)
    cell = ("#pragma taas --device cpu --gpus 2 --trials 4 --parallel 2 --sampler grid --prune none\n"
            "import taas, time\n"
            "g = taas.trial().suggest_categorical('g', [1, 2])\n"
            "time.sleep(0.5 * g)\n"
            "taas.report(0, loss=float(g))\n")
    ran = kernel.execute(cell, timeout=240)
    assert ran.reply["status"] == "ok", ran.error_text()
    rows = json.loads(kernel.execute("import taas\nprint(taas.trials()[['params', 'state']].to_json(orient='records'))")
                      .stream())
    assert sorted((row["params"]["g"], row["state"]) for row in rows) == [(1, "complete"), (2, "complete")], rows


def test_a_search_whose_every_trial_fails_fails_with_the_first_error(kernel):
    cell = ("#pragma taas --device cpu --gpus 2 --trials 2\n"
            "import taas\n"
            "taas.trial().suggest_int('n', 1, 3)\n"
            "raise RuntimeError('nothing works')\n")
    ran = kernel.execute(cell, timeout=240)
    assert ran.reply["status"] == "error"
    assert ran.error["ename"] == "RankFailed" and "nothing works" in ran.error_text(), ran.error_text()
    assert "no trial of 2 completed (2 failed)" in ran.stream("stderr")
    assert kernel.execute("1 + 1").result["text/plain"] == "2"


def test_the_pruner_stops_a_bad_trial_at_once_and_its_slot_goes_on(kernel):
    # the median pruner prunes from the sixth trial on: trials 0-4 report 1.0, trial 5 reports 10.0
    cell = ("#pragma taas --device cpu --gpus 2 --trials 6 --prune median\n"
            "import taas, time\n"
            "tp = taas.trial()\n"
            "tp.suggest_float('u', 0.0, 1.0)\n"
            "for step in range(400):\n"
            "    taas.report(step, loss=10.0 if tp.number == 5 else 1.0)\n"
            "    time.sleep(0.05 if tp.number == 5 else 0.0)\n"
            "print('trial', tp.number, 'reached the end', flush=True)\n")
    ran = kernel.execute(cell, timeout=300)
    assert ran.reply["status"] == "ok", ran.error_text()
    assert "taas: trial 5 pruned at step" in ran.stream(), ran.stream()
    rows = json.loads(kernel.execute("import taas\n"
                                     "print(taas.trials()[['number', 'state', 'seconds', 'log']].to_json(orient='records'))")
                      .stream())
    assert [row["state"] for row in rows] == ["complete"] * 5 + ["pruned"]
    assert rows[5]["seconds"] < 400 * 0.05 / 2  # stopped long before its 20 s of steps (about 0.4 s here, loaded)
    printed = [json.loads(line) for line in Path(rows[5]["log"]).read_text().splitlines()]
    assert not any("reached the end" in entry.get("text", "") for entry in printed)
    studied = kernel.execute("from optuna.trial import TrialState\n"
                             "print(taas.study().trials[-1].state == TrialState.PRUNED)").stream()
    assert studied.strip() == "True"


def test_a_named_study_is_continued_by_a_rerun(new_kernel, tmp_path):
    lone = new_kernel(cwd=str(tmp_path))
    cell = ("#pragma taas --device cpu --gpus 2 --trials 2 --study lrs --sampler random\n"
            "import taas\n"
            "v = taas.trial().suggest_float('v', -1.0, 1.0)\n"
            "taas.report(0, loss=v * v)\n")
    first = lone.execute(cell, timeout=240)
    assert first.reply["status"] == "ok", first.error_text()
    second = lone.execute(cell, timeout=240)
    assert second.reply["status"] == "ok", second.error_text()
    assert "study 'lrs' in" in second.stream() and "2 trial(s) before this cell" in second.stream()
    numbers = lone.execute("print(list(taas.trials()['number']), len(taas.study().trials))").stream()
    assert numbers.strip() == "[2, 3] 4"  # numbered on from the study's earlier trials
    kept = tmp_path / ".taas" / "studies.db"
    assert stat.S_IMODE(os.stat(kept).st_mode) == 0o600
    other_way = lone.execute(cell.replace("--sampler random", "--sampler random --maximize"))
    assert other_way.reply["status"] == "error" and "was made to minimize" in other_way.error_text()


def test_an_interrupt_stops_every_trial_and_leaves_nothing(kernel):
    cell = ("#pragma taas --device cpu --gpus 2 --trials 8 --parallel 2\n"
            "import taas, time\n"
            "taas.trial().suggest_int('k', 0, 9)\n"
            "for step in range(600):\n"
            "    taas.report(step, loss=1.0)\n"
            "    print('step', step, flush=True)\n"
            "    time.sleep(0.1)\n")
    msg_id, started = kernel.submit(cell)
    kernel.wait_for(msg_id, _table_shows(lambda table: table.count(" running ") == 2), "two trials side by side")
    time.sleep(1.0)
    kernel.manager.interrupt_kernel()
    stopped = kernel.collect(msg_id, started, timeout=120)
    assert stopped.error["ename"] == "KeyboardInterrupt", stopped.error_text()
    rows = json.loads(kernel.execute("import taas\nprint(taas.trials()[['state']].to_json(orient='records'))").stream())
    assert [row["state"] for row in rows] == ["stopped", "stopped"]  # two ran side by side; no third started
    assert kernel.execute("from optuna.trial import TrialState\n"
                          "print({t.state.name for t in taas.study().trials})").stream().strip() == "{'FAIL'}"


def test_taas_trial_outside_a_search_gives_the_defaults_and_says_what_is_missing(kernel):
    alone = kernel.execute("import taas\nft = taas.trial()\n"
                           "print(ft.suggest_float('lr', 1e-4, 1.0, log=True, default=0.01), "
                           "ft.suggest_categorical('opt', ['adam', 'sgd'], default='sgd'), ft.number, ft.params)").stream()
    assert alone.strip() == "0.01 sgd 0 {'lr': 0.01, 'opt': 'sgd'}"
    missing = kernel.execute("taas.trial().suggest_int('layers', 1, 4)", timeout=30)
    assert missing.error["ename"] == "ValueError" and "has no default=" in missing.error["evalue"]
    in_a_run = kernel.execute("#pragma taas --device cpu --gpus 2\n"
                              "import taas\n"
                              "run_alone = taas.trial().suggest_int('layers', 1, 4, default=3)\n")
    assert in_a_run.reply["status"] == "ok", in_a_run.error_text()
    assert kernel.execute("run_alone").result["text/plain"] == "3"


def test_search_options_without_trials_are_refused_with_nothing_launched(kernel):
    refused = kernel.execute("#pragma taas --device cpu --gpus 2 --maximize\nprint('never')\n")
    assert refused.error["ename"] == "PragmaError" and "--maximize belongs to a search: add --trials K" in refused.error_text()
    grid = kernel.execute("#pragma taas --device cpu --gpus 2 --trials 2 --sampler grid\n"
                          "import taas\nlow = 0.1\ntaas.trial().suggest_float('lr', low, 1.0, step=0.1)\n")
    assert grid.error is not None and "not literal values" in grid.error_text(), grid.error_text()
