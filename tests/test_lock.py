"""requirements-lock.txt (`make lock`, used by `make install` as constraints) against pyproject.toml: every
requirement `.[test]` pulls in is pinned there, for every supported Python, at a version its specifier allows; the
editable ironlm itself is never pinned. A dependency added or re-bounded in pyproject without `make lock` fails
here, before a clean clone installs something the lock never saw."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.markers import Marker, default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the suite's venv is 3.11+
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements-lock.txt"
PYTHONS = ["3.10.12", "3.11.7", "3.12.3", "3.13.1"]


def _pins() -> dict[str, list[tuple[Version, Marker | None]]]:
    pins: dict[str, list[tuple[Version, Marker | None]]] = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, _, marker = line.partition(";")
        name, sep, version = spec.strip().partition("==")
        assert sep, f"not an exact pin in {LOCK.name}: {line!r}"
        pins.setdefault(canonicalize_name(name), []).append(
            (Version(version.strip()), Marker(marker.strip()) if marker.strip() else None))
    return pins


def _requirements(extra: str = "test") -> list[tuple[Requirement, str]]:
    """(requirement, the extra it came from) for the base dependencies and `extra`, self-references expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = [(Requirement(r), "") for r in project["dependencies"]]
    todo, seen = [extra], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for r in map(Requirement, project["optional-dependencies"][name]):
            if canonicalize_name(r.name) == "ironlm":
                todo.extend(r.extras)
            else:
                out.append((r, name))
    return out


@pytest.mark.parametrize("python", PYTHONS)
def test_every_requirement_is_pinned_within_its_specifier(python: str) -> None:
    pins = _pins()
    env = {**default_environment(), "python_full_version": python, "python_version": python.rsplit(".", 1)[0],
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    for req, extra in _requirements():
        if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
            continue
        name = canonicalize_name(req.name)
        applicable = [v for v, m in pins.get(name, []) if m is None or m.evaluate(env)]
        assert len(applicable) == 1, f"{req} (python {python}): {len(applicable)} pins in {LOCK.name}; run make lock"
        assert req.specifier.contains(applicable[0], prereleases=True), \
            f"{req}: {LOCK.name} pins {applicable[0]}; run make lock"


def test_the_editable_package_is_not_pinned() -> None:
    assert "ironlm" not in _pins()  # a pin would make `uv pip install -e .` refuse the working tree's version


def test_make_install_uses_the_lock() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "LOCK   := requirements-lock.txt" in makefile
    assert "pip install --python $(PY) -c $(LOCK) -e '.[test]'" in makefile
