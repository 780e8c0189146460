"""The ``%taas`` line commands are one table (kernel/magic/commands.py's COMMANDS): a line finds its
row by the row's words and argument, and ``%taas help``, the docs' reference and the docs' check of
``%taas WORD`` are made from the same rows; a line no row takes is the one UsageError it always was."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
from IPython.core.error import UsageError

from taas_magic.kernel.magic import commands
from taas_magic.kernel.magic.commands import COMMANDS, HELP, find, run

HOOK = Path(__file__).resolve().parents[2] / "docs" / "hooks" / "reference.py"


def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(usage: str) -> commands.LineCommand:
    (row,) = [command for command in COMMANDS if command.usage == usage]
    return row


@pytest.mark.parametrize(("line", "usage", "arguments"), [
    ("", "%taas help", ()),
    ("  help  ", "%taas help", ()),
    ("status", "%taas status", ()),
    ("config repo ~/my repo", "%taas config repo PATH", ("~/my repo",)),
    ("config isolation python", "%taas config isolation auto|overlay|python", ("python",)),
    ("cluster", "%taas cluster", ()),
    ("cluster ray://head:10001", "%taas cluster ADDRESS|local", ("ray://head:10001",)),
    ("cluster off", "%taas cluster ADDRESS|local", ("off",)),
    ("cluster slurm", "%taas cluster slurm [OPTIONS]", ()),
    ("cluster  slurm -N 2  --time 1:00", "%taas cluster slurm [OPTIONS]", ("-N 2  --time 1:00",)),
    ("cluster slurmish", "%taas cluster ADDRESS|local", ("slurmish",)),
    ("warm 2", "%taas warm off|auto|N", ("2",)),
    ("runs", "%taas runs", ()),
    ("attach", "%taas attach [RUN]", ()),
    ("wait r1a2", "%taas wait [RUN]", ("r1a2",)),
    ("stop r1", "%taas stop [RUN]", ("r1",)),
    ("debug", "%taas debug [RUN]", ()),
    ("trials", "%taas trials", ()),
    ("study", "%taas study", ()),
])
def test_a_line_finds_its_row_by_words_and_argument(line, usage, arguments):
    assert find(line) == (_row(usage), arguments)


@pytest.mark.parametrize("line", ["nope", "statuses", "help me", "runs all", "warm", "warm 1 2", "wait a b",
                                  "debug a b", "config", "config repo", "config isolation", "trials 3"])
def test_a_line_no_row_takes_is_the_unknown_command_usage_error(line):
    with pytest.raises(UsageError) as raised:
        find(line)
    assert str(raised.value) == f"taas: unknown %taas command {line.strip()!r}; try %taas help or %taas status"


def test_every_row_is_reached_listed_in_help_and_in_the_docs():
    table = _hook().commands_table()
    for row in COMMANDS:
        line = " ".join(row.words + (("x",) if row.argument and not row.optional else ()))
        assert find(line)[0] is row, row.usage  # no row is shadowed by another
        assert f"  {row.usage}  " in HELP and row.help in HELP, row.usage
        assert f"| `{row.usage}` |" in table, row.usage
    assert len({row.usage for row in COMMANDS}) == len(COMMANDS)


def test_the_docs_know_each_commands_first_word_and_no_other():
    hook = _hook()
    hook.check_page("guide/runs.md", "".join(f"`%taas {row.words[0]}`\n" for row in COMMANDS))
    with pytest.raises(hook.PluginError, match="'%taas resume' is not a line command"):
        hook.check_page("guide/runs.md", "Then `%taas resume RUN`.\n")


def test_run_calls_the_rows_handler_with_the_session_the_settings_and_the_argument(tmp_path, capsys):
    session = SimpleNamespace(runs=SimpleNamespace(all=lambda: []), repository=None)
    run("", session, None)
    assert capsys.readouterr().out == HELP + "\n"
    run(f"config repo {tmp_path}", session, None)
    assert session.repository == str(tmp_path.resolve()) and capsys.readouterr().out == f"taas: repository {tmp_path.resolve()}\n"
    with pytest.raises(UsageError, match=r"^taas: the repository must be a directory, got '/no such/dir'$"):
        run("config repo /no such/dir", session, None)  # the rest of the line, spaces and all
    with pytest.raises(UsageError, match=r"^taas: isolation must be one of .*, got 'a b'$"):
        run("config isolation a b", session, None)
    with pytest.raises(UsageError, match="no search has run in this kernel yet"):
        run("trials", session, None)


def test_the_functions_of_taas_reach_the_handlers_only_where_the_extension_is_loaded():
    import taas

    for call, name in ((lambda: taas.wait("r1"), "wait"), (taas.trials, "trials"), (taas.study, "study")):
        with pytest.raises(RuntimeError, match=rf"^taas\.{name}\(\): the taas_magic extension is not loaded here"):
            call()
