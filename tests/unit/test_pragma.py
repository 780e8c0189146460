import pytest

from taas_magic.cell.options import PragmaError
from taas_magic.cell.pragma import PragmaOptions, parse_cell, parse_options
from taas_magic.cell.transformer import await_taas_cell, route_taas_cell

VALID = [
    ("--gpus 8", PragmaOptions(gpus=8)),
    ("--gpus=2", PragmaOptions(gpus=2)),
    ("--gpus 8 --cpus 1 --units 20480000", PragmaOptions(gpus=8, cpus=1, units=20480000)),
    ("--gpus 1 --cpus 8", PragmaOptions(gpus=1, cpus=8)),
    ("--gpus 2 --timeout 2.5", PragmaOptions(gpus=2, timeout=2.5)),
    ("--gpus 2 --restarts 3", PragmaOptions(gpus=2, restarts=3)),
    ("--gpus 2 --restarts=0", PragmaOptions(gpus=2, restarts=0)),
    ("--output all --gpus 3", PragmaOptions(gpus=3, output="all")),
    ("--gpus auto", PragmaOptions(gpus="auto")),
    ("--gpus=auto --device cpu", PragmaOptions(gpus="auto", device="cpu")),
    ("--device cuda --gpus 2", PragmaOptions(gpus=2, device="cuda")),
    ("--gpus 2 --device=auto", PragmaOptions(gpus=2, device="auto")),
    ("  --gpus   4   --output=rank0 ", PragmaOptions(gpus=4, output="rank0")),
]


@pytest.mark.parametrize(("args", "expected"), VALID)
def test_valid_options(args, expected):
    assert parse_options(args) == expected


# (cell, the token the one-line message must name)
MALFORMED_CELLS = [
    ("#pragma taas", "--gpus N|auto is required"),
    ("#pragma taas --cpus 2", "--gpus N|auto is required"),
    ("#pragma taas --gpus AUTO", "'AUTO'"),
    ("#pragma taas --gpus 2 --device gpu", "--device must be one of auto, cpu, cuda, got 'gpu'"),
    ("#pragma taas --gpus 2 --device", "--device needs a value"),
    ("#pragma taas --gpus 2 --device cpu --device cpu", "duplicate option '--device'"),
    ("#pragma taas --gpus", "--gpus needs a value"),
    ("#pragma taas --gpus --cpus 2", "--gpus needs a value"),
    ("#pragma taas --gpus=", "'--gpus='"),
    ("#pragma taas --gpus 0", "'0'"),
    ("#pragma taas --gpus -1", "'-1'"),
    ("#pragma taas --gpus two", "'two'"),
    ("#pragma taas --gpus 1.5", "'1.5'"),
    ("#pragma taas --gpus 0x10", "'0x10'"),
    ("#pragma taas --gpus 2 --gpus 2", "duplicate option '--gpus'"),
    ("#pragma taas --gpus 2 --gpus=4", "duplicate option '--gpus'"),
    ("#pragma taas --gpus 2 --cpus 0", "'0'"),
    ("#pragma taas --gpus 2 --cpus 9", "'9'"),
    ("#pragma taas --gpus 2 --cpus -3", "'-3'"),
    ("#pragma taas --gpus 2 --cpus x", "'x'"),
    ("#pragma taas --gpus 2 --units 0", "'0'"),
    ("#pragma taas --gpus 2 --units -5", "'-5'"),
    ("#pragma taas --gpus 2 --units 1e6", "'1e6'"),
    ("#pragma taas --gpus 2 --units", "--units needs a value"),
    ("#pragma taas --gpus 2 --timeout 0", "'0'"),
    ("#pragma taas --gpus 2 --restarts -1", "'-1'"),
    ("#pragma taas --gpus 2 --restarts 101", "'101'"),
    ("#pragma taas --gpus 2 --restarts two", "'two'"),
    ("#pragma taas --gpus 2 --timeout -1", "'-1'"),
    ("#pragma taas --gpus 2 --timeout soon", "'soon'"),
    ("#pragma taas --gpus 2 --timeout nan", "'nan'"),
    ("#pragma taas --gpus 2 --timeout inf", "'inf'"),
    ("#pragma taas --gpus 2 --output some", "'some'"),
    ("#pragma taas --gpus 2 --output", "--output needs a value"),
    ("#pragma taas --gpus 2 --nodes 2", "unknown option '--nodes'"),
    ("#pragma taas --gpus 2 -g 2", "unknown option '-g'"),
    ("#pragma taas --GPUS 2", "unknown option '--GPUS'"),
    ("#pragma taas gpus=2", "unexpected token 'gpus=2'"),
    ("#pragma taas --gpus 2 extra", "unexpected token 'extra'"),
    ("#pragma taas --gpus 2 3", "unexpected token '3'"),
    ("#pragma taas --gpus 2\n#pragma taas --gpus 4\nx = 1", "two pragmas"),
    ("#pragma taas --gpus 2\nx = 1\n#pragma taas --gpus 4", "line 3"),
    ("x = 1\n#pragma taas --gpus 2", "must come before any code, found on line 2"),
    ("import torch\n\n#pragma taas --gpus 2\nprint(1)", "line 3"),
    ("#!\n#pragma taas --gpus 2", "bad config line"),
    ("#! g2 8\n#pragma taas --gpus 2", "bad config line"),
]


@pytest.mark.parametrize(("cell", "named"), MALFORMED_CELLS)
def test_malformed_cells_name_the_bad_token(cell, named):
    with pytest.raises(PragmaError) as info:
        parse_cell(cell)
    message = str(info.value)
    assert named in message
    assert message.startswith("taas: ")
    assert len(message.splitlines()) == 2  # the reason, then the usage line


MALFORMED_MAGIC = [
    ("--gpus 2", "#pragma taas --gpus 2\nx = 1", "two pragmas"),
    ("--gpus 0", "x = 1", "'0'"),
    ("--bogus", "x = 1", "unknown option '--bogus'"),
]


@pytest.mark.parametrize(("line", "cell", "named"), MALFORMED_MAGIC)
def test_malformed_magic_lines(line, cell, named):
    with pytest.raises(PragmaError, match=named.replace("(", r"\(")):
        parse_cell(cell, line)


def test_config_lines_are_recorded_and_line_numbers_kept():
    cell = "\n#!g2.8\n#pragma taas --gpus 8\nx = 1\n"
    parsed = parse_cell(cell)
    assert parsed.options == PragmaOptions(gpus=8, configs=("g2.8",))
    assert parsed.source.splitlines()[3] == "x = 1"  # still line 4, as the person wrote it
    assert parsed.source.splitlines()[0] == "#"  # blank line above the head kept as a comment


def test_magic_form_keeps_line_numbers():
    parsed = parse_cell("#!g1.1\nprint(1)\n", "--gpus 1")
    assert parsed.options.configs == ("g1.1",)
    assert parsed.source.splitlines()[2] == "print(1)"  # line 3 of the cell with %%taas on line 1


def test_pragma_error_pickles():
    import pickle

    error = PragmaError("duplicate option '--gpus'")
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


TRANSFORMS = [
    ("#pragma taas --gpus 2\nx = 1\n", "%%taas\n#pragma taas --gpus 2\nx = 1\n"),
    ("#!g2.8\n#pragma taas --gpus 2\n", "%%taas\n#!g2.8\n#pragma taas --gpus 2\n"),
    ("\n\n#pragma taas --gpus 2\n", "%%taas\n\n\n#pragma taas --gpus 2\n"),
    ("x = 1\n#pragma taas --gpus 2\n", "%%taas\nx = 1\n#pragma taas --gpus 2\n"),  # routed, then refused
    ("x = 1\n", "x = 1\n"),
    ("#!g2.8\nx = 1\n", "#!g2.8\nx = 1\n"),
    ("# pragma taasx\n", "# pragma taasx\n"),
    ("#pragma once\n", "#pragma once\n"),
    ("%%time\n#pragma taas --gpus 2\n", "%%time\n#pragma taas --gpus 2\n"),
    ("%%taas --gpus 2\nx = 1\n", "%%taas --gpus 2\nx = 1\n"),
]


@pytest.mark.parametrize(("cell", "expected"), TRANSFORMS)
def test_transformer(cell, expected):
    lines = cell.splitlines(keepends=True)
    once = route_taas_cell(lines)
    assert "".join(once) == expected
    assert route_taas_cell(once) == once  # idempotent


AWAITS = [
    ("%%taas\n#pragma taas --gpus 2\nx = 1\n", "await __import__('taas_magic').run_cell('', '#pragma taas --gpus 2\\nx = 1\\n')\n"),
    ("%%taas --gpus 2 --detach\nx = 'a'\n", "await __import__('taas_magic').run_cell('--gpus 2 --detach', \"x = 'a'\\n\")\n"),
    ("\n%%taas --gpus 1\n", "await __import__('taas_magic').run_cell('--gpus 1', '')\n"),
    ("%%taasx\nx = 1\n", "%%taasx\nx = 1\n"),
    ("%%time\nx = 1\n", "%%time\nx = 1\n"),
    ("x = 1\n", "x = 1\n"),
]


@pytest.mark.parametrize(("cell", "expected"), AWAITS)
def test_a_taas_cell_becomes_one_await_of_the_magics_coroutine(cell, expected):
    once = await_taas_cell(cell.splitlines(keepends=True))
    assert "".join(once) == expected
    assert await_taas_cell(once) == once  # idempotent
    assert route_taas_cell(once) == once  # and the first step leaves it alone
