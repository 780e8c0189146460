"""One cell prepared to run (taas_magic/cell/prepared.py), the path both faces take: the magic's run and
``%taas export``."""

from __future__ import annotations

import pytest
from IPython.core.interactiveshell import InteractiveShell

from taas_magic.cell.options import PragmaError
from taas_magic.cell.prepared import prepare
from taas_magic.launch.rankenv import RankChoice

SESSION = {"cache_ram": "", "ahead": 16, "timeout": 90.0, "hang": 30.0, "place_timeout": 60.0, "restarts": 0,
           "output": "rank0", "keep": False}


@pytest.fixture
def shell():
    shell = InteractiveShell.instance()
    before = dict(shell.user_ns)
    yield shell
    shell.user_ns.clear()
    shell.user_ns.update(before)


def test_the_pragma_over_the_session_the_ranks_chosen_the_code_and_the_names_it_reads(shell):
    shell.user_ns.update(lr=0.5, unused=1)
    asked = []

    def choose(options):
        asked.append((options.gpus, options.device))
        return RankChoice(3, "3 of this host's GPUs")

    prepared = prepare(shell, "#pragma taas --gpus auto --restarts 2\nw = lr * 2\n%time x = 1\n", None, SESSION, choose)
    assert asked == [("auto", "auto")]
    settings = prepared.settings
    assert (settings.gpus, settings.restarts, settings.timeout) == (3, 2, 90.0)  # the pragma's, the session's
    assert prepared.why == "3 of this host's GPUs"
    assert prepared.closure == {"lr": 0.5}
    assert "get_ipython()" in prepared.code.source and "%time" in prepared.code.display_source


def test_a_magic_line_is_the_head(shell):
    prepared = prepare(shell, "y = 1\n", "--gpus 2 --device cpu", SESSION, lambda options: RankChoice(options.gpus))
    assert prepared.settings.gpus == 2 and prepared.settings.device == "cpu" and prepared.why is None


def test_a_bad_head_or_a_refused_choice_is_one_error_and_nothing_else_is_done(shell):
    with pytest.raises(PragmaError):
        prepare(shell, "#pragma taas --gpus two\nx = 1\n", None, SESSION, lambda options: RankChoice(1))

    def refuse(options):
        raise ValueError("taas: no GPUs here")

    with pytest.raises(ValueError, match="no GPUs here"):
        prepare(shell, "#pragma taas --gpus 4\nx = 1\n", None, SESSION, refuse)
