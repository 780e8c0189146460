"""How a rank runs its cell (taas_magic/rank/execute.py): as a module's body, its last expression split off and
evaluated (the cell's ``Out``), and a failure's traceback as a local one reads: from the cell's first frame down, the
cell named ``Cell In[n]`` with the person's own lines (the display source, not the translated one), an earlier cell's
function named by its own label; and the signature that tells a deterministic bug (restarts.py).

Real cells are run in real modules; the process-wide tables the rank fills (``linecache.cache`` and the earlier
cells' labels) are replaced by empty ones for each test, so nothing leaks into pytest's own tracebacks."""

from __future__ import annotations

import json
import linecache
import types

import pytest

from taas_magic.rank import execute
from taas_magic.rank.execute import (
    NO_VALUE,
    cell_label,
    format_cell_traceback,
    register_cells,
    register_source,
    run_cell,
    signature,
)

CELL = "<taas In[7]>"


@pytest.fixture(autouse=True)
def tables(monkeypatch):
    """linecache's cache and the earlier cells' labels, fresh for the test and put back after it."""
    monkeypatch.setattr(linecache, "cache", {})
    monkeypatch.setattr(execute, "_CELL_LABELS", {})


def module() -> types.ModuleType:
    made = types.ModuleType("__main__")
    made.__dict__["__builtins__"] = __builtins__
    return made


def raised(source: str, namespace: types.ModuleType | None = None, filename: str = CELL) -> BaseException:
    """What running ``source`` as the cell raised."""
    with pytest.raises(BaseException) as caught:
        run_cell(source, filename, namespace or module())
    return caught.value


@pytest.mark.parametrize(("source", "value"), [
    ("x = 2\nx * 21", 42),
    ("def f():\n    return 'made'\nf()", "made"),
    ("[i * i for i in range(4)]", [0, 1, 4, 9]),
    ("print('said')", None),  # an expression whose value is None is a value (IPython shows no Out for it either)
])
def test_the_last_expression_is_the_cells_value(source, value):
    assert run_cell(source, CELL, module()) == value


@pytest.mark.parametrize("source", ["", "x = 1", "for i in range(2):\n    i", "import os", "# only a comment\n", "y = 3\ny += 1"])
def test_a_cell_that_ends_with_a_statement_has_no_value(source):
    assert run_cell(source, CELL, module()) is NO_VALUE


def test_the_cell_binds_its_names_in_the_module_it_runs_in_and_sees_what_was_there():
    where = module()
    where.__dict__["given"] = 5
    run_cell("import json\ndef twice(v):\n    return 2 * v\nresult = twice(given)", CELL, where)
    assert where.result == 10 and where.json is json and where.twice.__module__ == "__main__"


def test_the_last_expression_is_evaluated_once_and_after_every_statement():
    where = module()
    assert run_cell("calls = []\ncalls.append(len(calls)) or calls", CELL, where) == [0]
    assert where.calls == [0]


def test_a_syntax_error_names_the_cell_and_the_line():
    error = raised("x = 1\ny = (\n")
    assert isinstance(error, SyntaxError) and error.filename == CELL
    assert "was never closed" in error.msg and error.lineno == 2


def test_a_traceback_starts_at_the_cell_and_shows_the_persons_lines_under_its_label():
    """The display source (what the person typed, ``!ls``) is shown, not the translated source the rank ran."""
    source = "get_ipython = None\nvalue = 1\nvalue / 0\n"
    register_source(CELL, "!ls\nvalue = 1\nvalue / 0\n")
    text = format_cell_traceback(raised(source), CELL)
    lines = [line for line in text.splitlines() if line.strip(" ~^")]  # not the carets under the place (Python 3.11+)
    assert lines == [
        "Traceback (most recent call last):",
        "  Cell In[7], line 3, in <module>",
        "    value / 0",
        "ZeroDivisionError: division by zero",
    ]
    assert "execute.py" not in text and "run_cell" not in text  # our frames stripped


def test_an_earlier_cells_function_is_named_by_its_own_label_and_lines():
    earlier = "/tmp/ipykernel_4242/2841912830.py"  # IPython's name for In[3]'s code
    register_cells({earlier: (3, ["def parse(text):\n", "    return json.loads(text)\n"])})
    where = module()
    where.__dict__["json"] = json
    exec(compile("def parse(text):\n    return json.loads(text)\n", earlier, "exec"), where.__dict__)  # noqa: S102
    register_source(CELL, "parse('{')\n")
    text = format_cell_traceback(raised("parse('{')\n", where), CELL)
    assert "  Cell In[7], line 1, in <module>\n    parse('{')\n" in text
    assert "  Cell In[3], line 2, in parse\n    return json.loads(text)\n" in text
    assert text.rstrip().splitlines()[-1].startswith("json.decoder.JSONDecodeError: Expecting property name")
    assert text.index("Cell In[7]") < text.index("Cell In[3]") < text.index("json/decoder.py")  # library frames kept below
    assert cell_label(earlier) == "Cell In[3]" and linecache.getline(earlier, 2) == "    return json.loads(text)\n"


def test_an_error_that_never_passed_through_the_cell_keeps_its_whole_traceback():
    def outside():
        raise KeyError("k")

    try:
        outside()
    except KeyError as error:
        text = format_cell_traceback(error, CELL)
    assert "in outside" in text and "in test_an_error_that_never_passed_through_the_cell" in text
    assert text.endswith("KeyError: 'k'\n") and "Cell In[" not in text


def test_cells_are_labelled_as_ipython_labels_them_and_other_files_as_they_are():
    register_cells({"/tmp/ipykernel_4242/3906221054.py": (2, ["x = 1\n"])})
    assert cell_label("<taas In[12]>") == "Cell In[12]"
    assert cell_label("/tmp/ipykernel_4242/3906221054.py") == "Cell In[2]"  # an earlier cell, registered
    assert cell_label("<taas In[12]>.py") == "<taas In[12]>.py"  # the whole name, not a part of it
    assert cell_label("/usr/lib/python3/json/decoder.py") == "/usr/lib/python3/json/decoder.py"


def test_the_signature_is_the_type_and_the_innermost_notebook_frame():
    # the frame below the cell's (int's parsing) is not the notebook's
    assert signature(raised("x = 1\nint('seven')\n"), CELL) == ("ValueError", CELL, 2)
    earlier = "/tmp/ipykernel_4242/1150361733.py"
    register_cells({earlier: (4, ["def check(v):\n", "    assert v, 'empty'\n"])})
    where = module()
    exec(compile("def check(v):\n    assert v, 'empty'\n", earlier, "exec"), where.__dict__)  # noqa: S102
    assert signature(raised("\n\ncheck([])\n", where), CELL) == ("AssertionError", earlier, 2)


def test_the_same_bug_twice_has_the_same_signature_and_another_bug_another():
    source = "data = {}\nfor attempt in range(2):\n    pass\ndata['missing']\n"
    first, again = signature(raised(source), CELL), signature(raised(source), CELL)
    assert first == again == ("KeyError", CELL, 4)
    assert signature(raised(source.replace("data['missing']", "data.missing")), CELL) == ("AttributeError", CELL, 4)


def test_an_error_outside_the_notebooks_code_has_no_signature():
    assert signature(ValueError("made, never raised"), CELL) is None
    try:
        json.loads("{")
    except ValueError as error:
        assert signature(error, CELL) is None
