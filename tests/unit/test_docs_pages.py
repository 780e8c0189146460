"""The docs name the code as it is: the site builds strictly, its reference comes from the code's
tables, and the architecture page's packages and modules are the package's.

The docs site (mkdocs.yml, docs/) is built here with ``mkdocs build --strict``: a broken link,
a missing page, or a page naming an option, a ``%taas`` command, a ``TaasMagics`` setting or a
``TAAS_*`` variable the code lacks fails it (docs/hooks/reference.py, which also generates the
option, setting, command and API tables from the code). What the hook does not check, these do:

- docs/architecture.md has one heading per package, `` ### `taas_magic/PATH/` `` (and
  `` `taas_magic/` `` for the ground, `` `taas.py` `` for the API module): a package added, renamed
  or removed without the page fails here, as does a heading for a package that is gone;
- every module of a package is named (``name.py``) in its package's section, so a module
  added without a word on the page fails too.
"""

import html
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mkdocs.exceptions import PluginError

from taas_magic.cell.options import OPTIONS
from taas_magic.kernel.magic.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "taas_magic"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
HOOK = ROOT / "docs" / "hooks" / "reference.py"
HEADING = re.compile(r"^#{2,4} `(taas_magic/(?:[a-z_]+/)*|taas\.py)`\s*$", re.MULTILINE)


def _sections() -> dict[str, str]:
    """Each package heading of the architecture page and the text under it, up to the next heading."""
    text = ARCHITECTURE.read_text()
    marks = list(HEADING.finditer(text))
    sections: dict[str, str] = {}
    for mark, following in zip(marks, marks[1:] + [None]):
        end = following.start() if following else len(text)
        body = text[mark.end():end]
        body = re.split(r"^#{1,4} ", body, maxsplit=1, flags=re.MULTILINE)[0]  # up to any next heading
        assert mark.group(1) not in sections, f"docs/architecture.md names {mark.group(1)} twice"
        sections[mark.group(1)] = body
    return sections


def _packages() -> set[str]:
    found = {"taas_magic/", "taas.py"}
    for init in PACKAGE.rglob("__init__.py"):
        if init.parent != PACKAGE:
            found.add(str(init.parent.relative_to(ROOT)) + "/")
    return found


def test_the_architecture_page_names_exactly_the_packages():
    named = set(_sections())
    assert named == _packages(), (f"in the code, not on docs/architecture.md: {sorted(_packages() - named)}; "
                                  f"on the page, not in the code: {sorted(named - _packages())}")


def test_each_package_section_names_every_module_of_its_package():
    sections = _sections()
    missing = []
    for package in _packages() - {"taas.py"}:
        folder = ROOT / package
        for module in sorted(folder.glob("*.py")) + sorted(folder.glob("*.js")):
            named = re.search(rf"(?<![\w.-]){re.escape(module.name)}\b", sections[package])  # courier.py is not raycourier.py
            if module.name not in ("__init__.py", "__main__.py") and not named:
                missing.append(f"{package}{module.name}")
    assert not missing, f"modules not named in their package's section of docs/architecture.md: {missing}"


def test_the_headings_read_as_the_pattern_says():
    """A heading that looks like a package but is not written as the pattern (no code span, no
    trailing slash) would be skipped by the tests above; there is none."""
    loose = [line for line in ARCHITECTURE.read_text().splitlines()
             if re.match(r"^#{2,4} .*taas_magic", line) and not HEADING.match(line)]
    assert not loose, loose


def _hook():
    spec = importlib.util.spec_from_file_location("docs_reference_hook", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_site_builds_in_strict_mode(tmp_path):
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300, env={"NO_MKDOCS_2_WARNING": "1",
                                                                                        "PATH": "/usr/bin:/bin"})
    assert built.returncode == 0, built.stderr[-3000:]
    options = (tmp_path / "site" / "reference" / "options" / "index.html").read_text()
    assert all(option.flag in options for option in OPTIONS)


def test_the_option_table_is_the_codes_own_row_by_row():
    rows = [line for line in _hook().options_table().splitlines() if line.startswith("| [`--")]
    assert [re.match(r"\| \[`([^`]+)`\]", row).group(1) for row in rows] == [option.signature for option in OPTIONS]
    for row, option in zip(rows, OPTIONS):
        assert " ".join(option.help.split()) in html.unescape(row).replace("\\|", "|"), option.flag
        assert (f"`TaasMagics.{option.setting}`" in row) == (option.setting is not None), option.flag


def test_the_command_table_is_the_codes_own_row_by_row():
    rows = [line for line in _hook().commands_table().splitlines() if line.startswith("| `%taas")]
    assert rows == [f"| `{command.usage}` | {command.help} |" for command in COMMANDS]


@pytest.mark.parametrize(("page", "text", "named"), [
    ("guide/cell.md", "```python\n#pragma taas --gpus 2 --nope\nx = 1\n```\n", "--nope"),
    ("guide/cell.md", "Put `#pragma taas --gpus 2 --unit 5` on top.\n", "--unit"),
    ("reference/options.md", "### `--maximise`\n", "--maximise"),
    ("guide/runs.md", "Then `%taas resume RUN`.\n", "%taas resume"),
    ("guide/cell.md", "`%config TaasMagics.time_out = 5`\n", "TaasMagics.time_out"),
    ("guide/cell.md", "Set `TAAS_" + "NOT_A_VARIABLE=1`.\n", "TAAS_" + "NOT_A_VARIABLE"),  # split: no file names it
])
def test_a_page_naming_what_the_code_lacks_fails_the_build(page, text, named):
    with pytest.raises(PluginError, match=re.escape(named)):
        _hook().check_page(page, text)


def test_the_readme_is_at_most_two_hundred_lines_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200  # the rest is the docs site's
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert links and not [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
