"""Every suppression in the package says why, on its own line: ``# type: ignore[code]  # why``
and ``# noqa: CODE - why``. ruff and mypy (run by .ci/run) report suppressions that no longer
suppress anything; this test keeps the ones that do honest."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "taas.py", *sorted((ROOT / "taas_magic").rglob("*.py"))]
TYPE_IGNORE = re.compile(r"#\s*type:\s*ignore(?P<rest>.*)$")
NOQA = re.compile(r"#\s*noqa(?P<rest>.*)$")


def _suppressions(pattern: re.Pattern) -> list[tuple[str, str]]:
    found = []
    for path in SOURCES:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = pattern.search(line)
            if match:
                found.append((f"{path.relative_to(ROOT)}:{number}", match.group("rest")))
    return found


def test_every_type_ignore_names_its_code_and_says_why():
    bare = [where for where, rest in _suppressions(TYPE_IGNORE) if not re.match(r"\[[a-z-, ]+\]\s+#\s*\S", rest)]
    assert not bare, f"type: ignore without [code]  # reason: {bare}"


def test_every_noqa_names_its_code_and_says_why():
    bare = [where for where, rest in _suppressions(NOQA) if not re.match(r": [A-Z]+\d+(, [A-Z]+\d+)* - \S", rest)]
    assert not bare, f"noqa without CODE - reason: {bare}"
