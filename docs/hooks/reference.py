"""mkdocs hook: the reference pages' tables, generated from the code, and checks that no page
names what the code does not have.

Generated, at a marker on its own line:

- ``<!-- taas:options -->``: the pragma's options (``taas_magic.cell.options.OPTIONS``) and the
  options that belong to a search (``SEARCH_ONLY``);
- ``<!-- taas:settings -->``: the session settings (``TaasMagics``' configurable traitlets);
- ``<!-- taas:commands -->``: the ``%taas`` line commands
  (``taas_magic.kernel.magic.commands.COMMANDS``, the table that also dispatches them);
- ``<!-- taas:api -->``: the ``taas`` module's public functions (``taas.__all__``), each with its
  signature and docstring.

Checked on every page, failing the build with :class:`PluginError` naming the page and the token:

- every ``--flag`` on a line that starts ``#pragma taas`` or ``%%taas`` (in a code block, or an
  inline code span) is an option of ``OPTIONS``;
- every heading and table row of reference/options.md that names an option names one of
  ``OPTIONS``;
- every ``%taas WORD`` is a line command (WORD is the first of a ``COMMANDS`` row's words);
- every ``TaasMagics.name`` is a session setting;
- every ``TAAS_*`` variable a page names exists in the code, the tests or the benchmarks;

and once per build: every ``TAAS_*`` environment variable the code reads (a string literal in
taas_magic/ or taas.py) is documented in reference/environment.md.
"""

from __future__ import annotations

import ast
import functools
import inspect
import re
from pathlib import Path
from typing import Any, Callable, Iterator

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
ENVIRONMENT_PAGE = "reference/environment.md"
OPTIONS_PAGE = "reference/options.md"

MARKER_OPTIONS = "<!-- taas:options -->"
MARKER_SETTINGS = "<!-- taas:settings -->"
MARKER_COMMANDS = "<!-- taas:commands -->"
MARKER_API = "<!-- taas:api -->"
# Each marker belongs to one page, and that page must keep it (else its table would silently go).
MARKER_PAGES = {
    MARKER_OPTIONS: OPTIONS_PAGE,
    MARKER_SETTINGS: OPTIONS_PAGE,
    MARKER_COMMANDS: "reference/commands.md",
    MARKER_API: "reference/api.md",
}

# Strings matching TAAS_[A-Z0-9_]+ in the code that are not environment variables (none today).
NOT_ENVIRONMENT: frozenset[str] = frozenset()

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z][\w-]*)")
PRAGMA_START = re.compile(r"^\s*(#\s*pragma\s+taas\b|%%taas\b)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINE_COMMAND = re.compile(r"(?<![%\w])%taas[ \t]+([A-Za-z][\w-]*)")
SETTING = re.compile(r"\bTaasMagics\.([a-z_][a-z0-9_]*)")
TAAS_VARIABLE = re.compile(r"(?<![A-Za-z0-9_])(TAAS_[A-Z0-9_]+)")


def _fail(page: str, message: str) -> None:
    raise PluginError(f"docs/{page}: {message}")


# ---------------------------------------------------------------- what the code has


def _options() -> Any:
    from taas_magic.cell import options

    return options


def _line_commands() -> tuple[Any, ...]:
    """The rows of the ``%taas`` table (``LineCommand``: ``words``, ``usage``, ``help``, ``handler``)."""
    from taas_magic.kernel.magic.commands import COMMANDS

    return COMMANDS


def _settings() -> dict[str, Any]:
    from taas_magic.kernel.magic.magics import TaasMagics

    return dict(sorted(TaasMagics.class_traits(config=True).items()))


def _command_words() -> set[str]:
    return {command.words[0] for command in _line_commands()}


def _flags() -> set[str]:
    return {option.flag for option in _options().OPTIONS}


def _strings(path: Path) -> Iterator[str]:
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def _variables_read() -> dict[str, list[str]]:
    """``TAAS_*`` in the string literals of the package and of taas.py -> where."""
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "taas_magic").rglob("*.py")) + [ROOT / "taas.py"]:
        for text in _strings(path):
            for name in TAAS_VARIABLE.findall(text):
                if name not in NOT_ENVIRONMENT:
                    found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


@functools.cache
def _variables_known() -> frozenset[str]:
    """``TAAS_*`` anywhere in the code, the tests and the benchmarks (what a page may name): read once
    a build (on_pre_build clears it, for ``mkdocs serve``'s rebuilds), not once a page."""
    known: set[str] = set()
    for folder in ("taas_magic", "tests", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            known.update(TAAS_VARIABLE.findall(path.read_text()))
    known.update(TAAS_VARIABLE.findall((ROOT / "taas.py").read_text()))
    return frozenset(known)


# ---------------------------------------------------------------- generated tables


def _escape(text: str) -> str:
    """``<`` and ``>`` outside code spans as entities, so ``<repository>`` is not read as a tag."""
    parts = text.split("`")
    for index in range(0, len(parts), 2):  # the even parts lie outside code spans
        parts[index] = parts[index].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def _cell(text: str) -> str:
    """Plain text for a table cell: on one line, pipes escaped, no raw HTML."""
    return _escape(" ".join(text.split()).replace("|", "\\|"))


def _default(option: Any) -> str:
    if option.required:
        return "required"
    if option.default is None:
        return "—"
    if option.default is False:
        return "off"
    return f"`{option.default}`"


def options_table() -> str:
    options = _options()
    rows = ["| option | meaning | default | session setting |", "| --- | --- | --- | --- |"]
    for option in options.OPTIONS:
        anchor = option.flag.removeprefix("--")
        setting = f"`TaasMagics.{option.setting}`" if option.setting else "—"
        rows.append(f"| [`{option.signature}`](#{anchor}) | {_cell(option.help)} | {_default(option)} | {setting} |")
    search = ", ".join(f"`{flag}`" for flag in options.SEARCH_ONLY)
    usage = options.usage()
    return "\n".join(rows) + (
        f"\n\n**Only in a search** (with `--trials K`): {search}.\n\n"
        f"The usage line, as a malformed head prints it:\n\n```text\n{usage}\n```\n"
    )


def settings_table() -> str:
    rows = ["| setting | default | what it is |", "| --- | --- | --- |"]
    for name, trait in _settings().items():
        default = trait.default_value
        shown = "empty" if default == "" else "none" if default is None else f"`{default!r}`"
        rows.append(f"| `TaasMagics.{name}` | {shown} | {_cell(trait.help or '')} |")
    return "\n".join(rows) + "\n"


def commands_table() -> str:
    rows = ["| command | what it does |", "| --- | --- |"]
    rows += [f"| `{command.usage}` | {_cell(command.help)} |" for command in _line_commands()]
    return "\n".join(rows) + "\n"


_SECTION = re.compile(r"^(Args|Arguments|Returns|Raises|Yields|Note|Example|Examples):\s*$")


def _docstring(doc: str, names: set[str]) -> str:
    """A Google-style docstring as Markdown: ``code``, :func:`links`, sections as lists."""

    def role(match: re.Match[str]) -> str:
        target = match.group(2).lstrip("~").split(".")[-1] if match.group(1) == "func" else match.group(2)
        return f"[`{target}`](#{target})" if match.group(1) == "func" and target in names else f"`{target}`"

    text = re.sub(r":(\w+):`([^`]+)`", role, doc)
    text = _escape(re.sub(r"``([^`]+)``", r"`\1`", text))
    out: list[str] = []
    section = False
    for line in text.splitlines():
        header = _SECTION.match(line)
        if header:
            out += ["", f"**{header.group(1)}:**", ""]
            section = True
        elif section and line.startswith("        ") and out:
            out[-1] += " " + line.strip()  # a continuation of the entry above
        elif section and line.startswith("    "):
            name, colon, rest = line.strip().partition(":")
            out.append(f"- `{name}`:{rest}" if colon else f"- {line.strip()}")
        else:
            section = False if not line.startswith(" ") else section
            if line.startswith("- ") and out and out[-1] and not out[-1].startswith("- "):
                out.append("")
            out.append(line)
    return "\n".join(out).strip()


def api_reference() -> str:
    import taas

    names = set(taas.__all__)
    parts: list[str] = []
    for name in taas.__all__:
        function: Callable[..., Any] = getattr(taas, name)
        signature = str(inspect.signature(function, eval_str=True)).replace("typing.", "")
        doc = inspect.getdoc(function) or "(no docstring)"
        parts.append(f"### `taas.{name}` {{#{name}}}\n\n```python\ntaas.{name}{signature}\n```\n\n"
                     f"{_docstring(doc, names)}\n")
    return "\n".join(parts)


GENERATORS: dict[str, Callable[[], str]] = {
    MARKER_OPTIONS: options_table,
    MARKER_SETTINGS: settings_table,
    MARKER_COMMANDS: commands_table,
    MARKER_API: api_reference,
}


# ---------------------------------------------------------------- checks


def _lines(markdown: str) -> Iterator[tuple[int, str, bool]]:
    """Each line with its number and whether it lies inside a fenced code block (fences count as inside)."""
    fence: str | None = None
    for number, line in enumerate(markdown.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
            yield number, line, True
        elif fence is not None and match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence) \
                and not line.strip()[len(match.group(1)):].strip():
            fence = None
            yield number, line, True
        else:
            yield number, line, fence is not None


def _pragma_texts(markdown: str) -> Iterator[tuple[int, str]]:
    """The pragma lines of a page: code-block lines, and inline code spans, that start a taas cell."""
    for number, line, in_code in _lines(markdown):
        if in_code:
            if PRAGMA_START.match(line):
                yield number, line
        else:
            for span in INLINE_CODE.findall(line):
                if PRAGMA_START.match(span):
                    yield number, span


def check_page(page: str, markdown: str) -> None:
    flags = _flags()
    for number, text in _pragma_texts(markdown):
        for flag in FLAG.findall(text):
            if flag.split("=")[0] not in flags:
                _fail(page, f"line {number}: the pragma option {flag!r} is not in taas_magic.cell.options.OPTIONS "
                            f"({text.strip()!r})")
    if page == OPTIONS_PAGE:
        for number, line, in_code in _lines(markdown):
            if not in_code and line.lstrip().startswith(("#", "|")):
                for flag in FLAG.findall(line):
                    if flag not in flags:
                        _fail(page, f"line {number}: {flag!r} is named as an option but is not in OPTIONS")
    words = _command_words()
    settings = set(_settings())
    known = _variables_known()
    for number, line, _ in _lines(markdown):
        for word in LINE_COMMAND.findall(line):
            if word not in words:
                _fail(page, f"line {number}: '%taas {word}' is not a line command "
                            f"(taas_magic.kernel.magic.commands.COMMANDS has: {', '.join(sorted(words))})")
        for name in SETTING.findall(line):
            if name not in settings:
                _fail(page, f"line {number}: 'TaasMagics.{name}' is not a session setting")
        for name in TAAS_VARIABLE.findall(line):
            if name not in known:
                _fail(page, f"line {number}: {name!r} appears nowhere in the code, the tests or the benchmarks")


def check_environment(docs_dir: Path) -> None:
    path = docs_dir / ENVIRONMENT_PAGE
    if not path.exists():
        _fail(ENVIRONMENT_PAGE, "missing: it documents the environment variables the code reads")
    documented = set(TAAS_VARIABLE.findall(path.read_text()))
    for name, where in sorted(_variables_read().items()):
        if name not in documented:
            _fail(ENVIRONMENT_PAGE, f"{name!r} is read by the code ({', '.join(sorted(set(where)))}) "
                                    f"but not documented here")


# ---------------------------------------------------------------- mkdocs events


def on_pre_build(config: Any) -> None:
    _variables_known.cache_clear()  # the code may have changed since the last build (mkdocs serve)
    check_environment(Path(config["docs_dir"]))


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    src = page.file.src_uri
    for marker, owner in MARKER_PAGES.items():
        if src == owner and marker not in markdown:
            _fail(src, f"the marker {marker} is gone: the generated table would be missing")
        if marker in markdown:
            if src != owner:
                _fail(src, f"the marker {marker} belongs on {owner}")
            markdown = markdown.replace(marker, GENERATORS[marker]())
    check_page(src, markdown)
    return markdown
