"""JupyterLab's own debugger panel on a taas cell, in a real JupyterLab in a real headless Chromium: what a person
clicks and sees (debugger/panel.py).

The page: the notebook's bug button turns the debugger on; a click in the taas cell's breakpoint gutter puts a
breakpoint on a line only rank 1 reaches; the cell is run from the Run menu. Rank 1 stops there, and the panel's
Variables show rank 1's own value (``secret`` is 41 on rank 1, 40 on rank 0). The page is then reloaded while rank 1
is stopped: the panel, asking the kernel's ``debugInfo``, shows rank 1's variables again. The Callstack's Continue
lets the cell end, and shutting the kernel down leaves no process of the run.
"""

from __future__ import annotations

import time

import psutil
import pytest

from tests.browser.test_jupyterlab import (
    CHROMIUM,
    DRIVER,
    _cells,
    _code,
    _menu,
    _run_cell,
    _run_processes,
    _serve,
    _wait,
    _wait_idle,
)

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver (apt)"),
]
CELL = ("#pragma taas --device cpu --gpus 2\nimport os\nrank = int(os.environ['RANK'])\nsecret = 40 + rank\n"
        "if rank == 1:\n    seen = secret\nprint('done', rank, secret)\n")
LINE = 6  # seen = secret: only rank 1 runs it

# The Variables panel's rows, as text (name, then value), and the Callstack's frames.
_PANEL = """
const rows = Array.from(document.querySelectorAll('.jp-DebuggerVariables-body .jp-DebuggerVariables-name'))
  .map(name => [name.innerText.trim(), (name.parentElement.querySelector('.jp-DebuggerVariables-detail') || {}).innerText]);
const frames = Array.from(document.querySelectorAll('.jp-DebuggerCallstack-body li')).map(li => li.innerText);
return {rows: rows, frames: frames};
"""

# The breakpoint gutter's element beside line arguments[1] of code cell arguments[0] (CodeMirror 6 draws one per line).
_GUTTER = """
const cell = document.querySelectorAll('.jp-Notebook .jp-CodeCell')[arguments[0]];
const line = cell.querySelectorAll('.cm-content .cm-line')[arguments[1] - 1].getBoundingClientRect();
return Array.from(cell.querySelectorAll('.cm-gutter.cm-breakpoint-gutter .cm-gutterElement'))
  .find(element => { const box = element.getBoundingClientRect();
                     return box.height > 0 && Math.abs(box.top + box.height / 2 - (line.top + line.height / 2)) < 4; });
"""


@pytest.fixture
def panel_lab(tmp_path):
    notebook = {"cells": [_code("%load_ext taas_magic"), _code(CELL)], "nbformat": 4, "nbformat_minor": 5,
                "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}}}
    yield from _serve(tmp_path, "panel.ipynb", notebook)


def _variables(driver) -> dict[str, str]:
    return dict(driver.execute_script(_PANEL)["rows"])


def _debugger_on(driver) -> None:
    button = _wait(lambda: driver.find_elements(By.CSS_SELECTOR, ".jp-DebuggerBugButton:not([disabled])"), 60,
                   "the notebook's debugger button, enabled (a kernel that debugs)")[0]
    if button.get_attribute("aria-pressed") != "true":
        button.click()
    _wait(lambda: driver.find_elements(By.CSS_SELECTOR, ".jp-DebuggerBugButton[aria-pressed='true']"), 30,
          "the debugger to be on")
    _wait(lambda: driver.execute_script(_GUTTER, 1, LINE), 30, "the taas cell's breakpoint gutter")


def test_a_gutter_breakpoint_stops_rank_1_and_the_panel_shows_its_variable_even_after_a_reload(panel_lab, browser):
    url, _ = panel_lab
    started = time.time() - 1
    browser.get(url)
    _wait(lambda: len(_cells(browser)) == 2, 90, "the notebook's code cells")
    _wait_idle(browser)
    _run_cell(browser, 0)  # %load_ext taas_magic
    _wait_idle(browser)
    _debugger_on(browser)
    browser.execute_script(_GUTTER, 1, LINE).click()
    _wait(lambda: _cells(browser)[1].find_elements(By.CSS_SELECTOR, ".cm-breakpoint-gutter .cm-breakpoint-icon"), 20,
          "the breakpoint drawn in the gutter")
    _run_cell(browser, 1)
    shown = _wait(lambda: (rows := _variables(browser)).get("secret") and rows, 120, "rank 1's variables in the panel")
    assert shown["secret"] == "41" and shown["rank"] == "1", shown  # rank 1's own, not rank 0's 40

    _menu(browser, "File", "Save Notebook")
    browser.refresh()  # while rank 1 is stopped: the panel asks debugInfo and shows it again
    _wait(lambda: len(_cells(browser)) == 2, 90, "the notebook's cells after the reload")
    again = _wait(lambda: (rows := _variables(browser)).get("secret") and rows, 60,
                  "rank 1's variables in the panel after the reload")
    assert again["secret"] == "41", again
    _wait(lambda: browser.find_elements(By.CSS_SELECTOR, "button[title^='Continue']:not([disabled]), "
                                                         "jp-button[title^='Continue']:not([disabled])"),
          30, "the Callstack's Continue button")[0].click()
    _wait_idle(browser)
    _menu(browser, "Kernel", "Shut Down Kernel")
    _wait(lambda: not [p for p in _run_processes(started) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE],
          20, "the run's processes to be gone after the kernel's shutdown")
