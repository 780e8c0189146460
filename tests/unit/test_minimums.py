"""The declared minimums are the tested ones: .ci/minimums.txt, which .ci/run installs exactly in
its second venv (tests/unit and the kernel tests marked ``minimums`` run there), names the same
releases as pyproject.toml's ``>=`` for the package's dependencies and its [torch] extra."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def _declared() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {}
    for line in [*project["dependencies"], *project["optional-dependencies"]["torch"]]:
        requirement = Requirement(line)
        floors = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        assert len(floors) == 1, f"pyproject.toml: {line!r} states no minimum (>=)"
        declared[canonicalize_name(requirement.name)] = floors[0]
    return declared


def _pinned() -> dict[str, str]:
    pinned = {}
    for line in (ROOT / ".ci" / "minimums.txt").read_text().splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        requirement = Requirement(line)
        pins = [spec.version for spec in requirement.specifier if spec.operator == "=="]
        assert len(pins) == 1 and len(requirement.specifier) == 1, f".ci/minimums.txt: {line!r} is not NAME==VERSION"
        pinned[canonicalize_name(requirement.name)] = pins[0]
    return pinned


def test_ci_minimums_and_pyproject_name_the_same_releases():
    declared, pinned = _declared(), _pinned()
    assert declared == pinned, (
        "pyproject.toml's minimums (>=) and .ci/minimums.txt (what CI tests them with) disagree: "
        f"only in pyproject {sorted(set(declared.items()) - set(pinned.items()))}, "
        f"only in .ci/minimums.txt {sorted(set(pinned.items()) - set(declared.items()))}")
