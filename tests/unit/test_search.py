"""The search's parts without processes: the grid read from a cell, the trials, the slots, the table.

TrialLink is tested against a real Optuna study (ask, suggest, report, prune)."""

from __future__ import annotations

import ast
import pickle
import threading

import pytest

from taas_magic.cell.options import PragmaError
from taas_magic.cell.pragma import parse_options, settle
from taas_magic.errors import SearchError
from taas_magic.kernel.trials.searchplan import search_slots
from taas_magic.output.trialtable import TrialRow, search_display, table_text
from taas_magic.search.space import grid_space
from taas_magic.search.trial import FixedTrial, RemoteTrial, Suggest, Suggested

SESSION = {"cache_ram": "", "ahead": 16, "timeout": None, "hang": 30.0, "place_timeout": 60.0, "restarts": 0, "output": "rank0", "keep": False}


@pytest.mark.parametrize(("cell", "grid"), [
    ("t.suggest_categorical('opt', ['adam', 'sgd'])", {"opt": ["adam", "sgd"]}),
    ("t.suggest_int('layers', 1, 4)", {"layers": [1, 2, 3, 4]}),
    ("t.suggest_int('width', 16, 64, step=16)", {"width": [16, 32, 48, 64]}),
    ("t.suggest_float('lr', 0.1, 0.3, step=0.1, default=0.2)", {"lr": [0.1, 0.2, 0.3]}),
    ("a = trial.suggest_int(name='n', low=0, high=1)\nb = trial.suggest_categorical('c', (True,))", {"n": [0, 1], "c": [True]}),
    ("x = t.suggest_int('k', 1, 2)\ny = t.suggest_int('k', 1, 2)", {"k": [1, 2]}),
])
def test_the_grid_is_read_from_the_cells_literal_suggestions(cell, grid):
    assert grid_space(ast.parse(cell)) == grid


@pytest.mark.parametrize(("cell", "says"), [
    ("t.suggest_float('lr', low, 1.0, step=0.1)", "not literal values"),
    ("t.suggest_float('lr', 0.1, 1.0)", "needs step="),
    ("t.suggest_int('k', 1, 2)\nt.suggest_int('k', 1, 3)", "suggested twice with different values"),
    ("print('no suggestion')", "found no trial.suggest_"),
    ("t.suggest_int('k', 1)", "needs a name and low, high"),
])
def test_a_grid_that_cannot_be_read_names_the_call(cell, says):
    with pytest.raises(SearchError, match=says):
        grid_space(ast.parse(cell))


def test_a_fixed_trial_gives_defaults_checks_them_and_says_what_is_missing():
    fixed = FixedTrial()
    assert fixed.suggest_float("lr", 1e-4, 1.0, log=True, default=1e-2) == 1e-2
    assert fixed.suggest_int("layers", 1, 4, default=2) == 2
    assert fixed.suggest_categorical("opt", ["adam", "sgd"], default="sgd") == "sgd"
    assert (fixed.number, fixed.params) == (0, {"lr": 1e-2, "layers": 2, "opt": "sgd"})
    with pytest.raises(ValueError, match="has no default= and this cell is not a search"):
        fixed.suggest_int("depth", 1, 3)
    with pytest.raises(ValueError, match="outside"):
        fixed.suggest_float("lr", 0.1, 1.0, default=2.0)
    with pytest.raises(ValueError, match="not one of its choices"):
        fixed.suggest_categorical("opt", ["adam"], default="sgd")


def test_a_remote_trial_asks_each_suggestion_and_comes_back_as_the_values_it_gave():
    asked = []

    def ask(frame: Suggest) -> Suggested:
        asked.append(frame)
        return Suggested(frame.name, 0.5) if frame.name == "lr" else Suggested(frame.name, error="ValueError: no")

    remote = RemoteTrial(7, ask)
    assert remote.suggest_float("lr", 0.1, 1.0, log=True, default=0.3) == 0.5
    assert asked == [Suggest("lr", "float", {"low": 0.1, "high": 1.0, "step": None, "log": True})]
    with pytest.raises(ValueError, match="trial 7: suggest_int\\('k'\\): ValueError: no"):
        remote.suggest_int("k", 1, 2)
    back = pickle.loads(pickle.dumps(remote))
    assert isinstance(back, FixedTrial) and (back.number, back.params) == (7, {"lr": 0.5})
    assert back.suggest_float("lr", 0.1, 1.0) == 0.5  # its values again, no default needed


def test_a_trial_link_asks_optuna_once_per_name_and_answers_every_rank_the_same():
    optuna = pytest.importorskip("optuna")
    from taas_magic.search.link import TrialLink

    study = optuna.create_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=1))
    first = TrialLink(study.ask(), "loss", threading.Lock(), prunes=True)
    frame = Suggest("lr", "float", {"low": 0.1, "high": 1.0, "step": None, "log": True})
    answers = {first.answer(rank, frame).value for rank in range(4)}
    assert len(answers) == 1 and first.values == {"lr": answers.pop()}
    other = first.answer(1, Suggest("lr", "float", {"low": 0.2, "high": 1.0, "step": None, "log": False}))
    assert "other arguments" in other.error
    assert "ValueError" in first.answer(0, Suggest("n", "int", {"low": 5, "high": 1, "step": 1, "log": False})).error
    first.reported([(0, {"loss": 1.0}), (1, {"accuracy": 0.5}), (2, {"loss": 0.5})])
    assert list(first.curve) == [(0, 1.0), (2, 0.5)] and first.last == 0.5 and not first.pruned()
    study.tell(first.trial, first.last)
    second = TrialLink(study.ask(), "loss", threading.Lock(), prunes=True)
    second.reported([(0, {"loss": 5.0})])
    assert second.pruned()  # worse than the median of the completed trial at step 0


def test_the_search_options_parse_and_settle_and_belong_only_to_a_search():
    options = parse_options("--gpus 2 --trials 16 --parallel 2 --objective val_acc --maximize --sampler random "
                            "--prune halving --study lrs-1")
    settings = settle(options, SESSION, 2)
    assert (settings.trials, settings.parallel, settings.objective, settings.maximize, settings.sampler, settings.prune,
            settings.study) == (16, 2, "val_acc", True, "random", "halving", "lrs-1")
    plain = settle(parse_options("--gpus 2 --trials 3"), SESSION, 2)
    assert (plain.objective, plain.maximize, plain.sampler, plain.prune, plain.study) == ("loss", False, "tpe", "median", None)
    with pytest.raises(PragmaError, match="--sampler belongs to a search: add --trials K"):
        parse_options("--gpus 2 --sampler grid")
    with pytest.raises(PragmaError, match="--detach with --trials"):
        parse_options("--gpus 2 --trials 2 --detach")
    with pytest.raises(PragmaError, match="--study needs a name"):
        parse_options("--gpus 2 --trials 2 --study a/b")


@pytest.mark.parametrize(("pragma", "cluster", "host", "slots", "on_gpus"), [
    ("--gpus 2 --trials 16", None, 8, 4, True),  # eight GPUs, two per trial: four at a time
    ("--gpus 2 --trials 3", None, 8, 3, True),  # never more than the trials
    ("--gpus 2 --trials 16 --parallel 2", None, 8, 2, True),
    ("--gpus 2 --trials 16", None, 0, 1, False),  # no GPU: one at a time
    ("--gpus 2 --trials 16 --parallel 3", None, 0, 3, False),
    ("--gpus 2 --trials 16 --device cpu", None, 8, 1, False),
    ("--gpus 1 --trials 16", 6, 0, 6, False),  # the cluster's GPUs
])
def test_the_slots_follow_the_gpus_the_cluster_or_parallel(pragma, cluster, host, slots, on_gpus):
    settings = settle(parse_options(pragma), SESSION, parse_options(pragma).gpus)
    assert search_slots(settings, cluster, host)[:2] == (slots, on_gpus)


def test_more_parallel_trials_than_the_gpus_hold_are_refused():
    settings = settle(parse_options("--gpus 4 --trials 8 --parallel 3"), SESSION, 4)
    with pytest.raises(Exception, match="need 12 GPUs; this host has 8"):
        search_slots(settings, None, 8)


def test_the_table_marks_the_best_trial_and_the_chart_draws_a_line_per_trial():
    rows = [TrialRow(0, {"lr": 0.1, "opt": "sgd"}, "complete", 0.5, 0.4, 2.0, ((0, 0.9), (1, 0.5))),
            TrialRow(1, {"lr": 0.01, "opt": "adam"}, "pruned", 2.0, 2.0, 0.5, ((0, 2.0),)),
            TrialRow(2, {"lr": 0.02}, "running", None, None, 0.1)]
    text = table_text(rows, "loss", 0)
    assert text.splitlines()[0].split() == ["trial", "params", "state", "last", "loss", "best", "loss", "seconds"]
    assert text.splitlines()[1].split() == ["*0", "lr=0.1,", "opt=sgd", "complete", "0.5", "0.4", "2.0"]
    table, chart = search_display(rows, "loss", 0, ["epoch 1 <done>"])
    assert table["text/html"].count("<tr") == 4 and chart is not None and chart["image/svg+xml"].count("<polyline") == 2
    assert "epoch 1 &lt;done&gt;" in table["text/html"] and "trial 0's last lines:\nepoch 1 <done>" in table["text/plain"]
    assert search_display(rows[2:], "loss", None, [])[1] is None  # no chart before a trial reported


def test_without_optuna_a_search_says_how_to_install_it(monkeypatch):
    from taas_magic.search.study import optuna_module

    monkeypatch.setitem(__import__("sys").modules, "optuna", None)  # what a missing package imports as
    with pytest.raises(SearchError, match=r"--trials needs Optuna: pip install 'taas-magic\[trials\]'"):
        optuna_module()
