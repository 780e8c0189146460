"""The docs' complete cells run as written: each page's cells in one real kernel, in page order.

A code block on a docs page that is preceded by the line ``<!-- cell -->`` is a complete
cell (docs/development.md says so for writers): this test runs every such cell of a page, in
the page's order, in one fresh kernel with the extension loaded and a fresh working directory
(as a notebook that is the page would), and fails on the first cell that errors, naming the
page and the cell's first lines. Cells that need GPUs, a cluster or a person at a prompt are
left unmarked on the pages.
"""

import json
import re
from pathlib import Path

import pytest

from tests.kernel_client import Kernel, assert_nothing_left

DOCS = Path(__file__).resolve().parents[2] / "docs"
PRAGMA = re.compile(r"^\s*(#\s*pragma\s+taas|%%taas)\b", re.MULTILINE)
MARKED = re.compile(r"^<!-- cell -->\n```(?:python|py|ipython)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _pages() -> dict[str, list[str]]:
    pages = {}
    for page in sorted(DOCS.rglob("*.md")):
        cells = [cell for cell in MARKED.findall(page.read_text())]
        if cells:
            pages[str(page.relative_to(DOCS))] = cells
    return pages


PAGES = _pages()


def test_the_docs_have_complete_cells():
    assert sum(len(cells) for cells in PAGES.values()) >= 8, PAGES.keys()  # the marker is found at all


@pytest.mark.parametrize("page", sorted(PAGES))
def test_each_complete_cell_of_the_page_runs(page, tmp_path):
    kernel = Kernel(cwd=str(tmp_path))
    try:
        for number, cell in enumerate(PAGES[page], 1):
            ran = kernel.execute(cell, timeout=300)
            head = "\n".join(cell.splitlines()[:3])
            assert ran.reply["status"] == "ok", f"docs/{page}, cell {number}:\n{head}\n...\n{ran.error_text()}"
            if PRAGMA.search(cell):  # a taas cell ran as one: its header says how many ranks (a search's, how many trials)
                shown = json.dumps([m.content for m in ran.messages])
                assert re.search(r"taas: (\d+ rank\(s\)|search of \d+ trial\(s\))", shown), \
                    f"docs/{page}, cell {number} did not run as a taas cell:\n{head}"
        assert_nothing_left(kernel)
    finally:
        kernel.shutdown()
