"""The cell as the ranks run it (taas_magic/cell/cellcode.py): IPython's syntax translated with a real shell's
transformers, plain Python taken as it stands, lines kept."""

from __future__ import annotations

import ast

import pytest
from IPython.core.inputtransformer2 import TransformerManager
from IPython.core.interactiveshell import InteractiveShell

from taas_magic.cell import cellcode
from taas_magic.cell.cellcode import translate


@pytest.fixture(scope="module")
def shell():
    return InteractiveShell.instance()


@pytest.fixture
def transforms(monkeypatch):
    """How many times IPython's tokenizing translation ran."""
    calls = []
    original = TransformerManager.transform_cell

    def counted(self, cell):
        calls.append(cell)
        return original(self, cell)

    monkeypatch.setattr(TransformerManager, "transform_cell", counted)
    return calls


def test_plain_python_is_its_own_translation_and_is_not_tokenized_again(shell, transforms):
    code = translate(shell, "#pragma taas --gpus 2\nx = 1\nprint(x)\n")
    assert code.source == code.display_source and transforms == []
    assert ast.dump(code.tree) == ast.dump(ast.parse(code.source))


@pytest.mark.parametrize("cell, expected", [
    ("files = !ls\nprint(files)\n", "files = get_ipython().getoutput('ls')\nprint(files)\n"),
    ("%time y = 2\n", "get_ipython().run_line_magic('time', 'y = 2')\n"),
    ("\nx = 1\n", "x = 1\n"),  # a leading blank line: IPython drops it, as it does for the notebook's own cells
])
def test_ipython_syntax_and_a_leading_blank_line_are_translated_as_ipython_does(shell, transforms, cell, expected):
    assert translate(shell, cell).source == expected and transforms == [cell]


def test_with_an_extensions_own_transform_every_cell_is_translated(shell, transforms, monkeypatch):
    def shout(lines):
        return [line.replace("quiet", "LOUD") for line in lines]

    monkeypatch.setattr(shell.input_transformer_manager, "cleanup_transforms",
                        [*shell.input_transformer_manager.cleanup_transforms, shout])
    assert translate(shell, "quiet = 1\n").source == "LOUD = 1\n" and len(transforms) == 1
    assert cellcode._plain_python(TransformerManager(), "quiet = 1\n", "<cell>") is not None
