"""docs/ARCHITECTURE.md stays true: every repository path it names in backticks exists, and the Python package it
describes has no import cycles (the checker is tests/test_imports.py's)."""

from __future__ import annotations

import re
from pathlib import Path

from test_imports import find_cycles, import_graph

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# A backticked span naming a place in the repository: it starts at a top-level folder, no spaces.
_PATH = re.compile(r"`((?:python|rust|tests|docs|benches)/[^`\s]*)`")


def named_paths(text: str) -> list[str]:
    return sorted(set(_PATH.findall(text)))


def test_every_path_the_architecture_names_exists() -> None:
    paths = named_paths(DOC.read_text(encoding="utf-8"))
    # The doc really names the rooms of both halves (the regex is not vacuous).
    assert {"python/ironlm/engine/kv/", "rust/src/sched/radix/", "python/ironlm/server/"} <= set(paths)
    missing = [p for p in paths if not (ROOT / p).exists() or (p.endswith("/") and not (ROOT / p).is_dir())]
    assert not missing, f"docs/ARCHITECTURE.md names paths that do not exist: {missing}"


def test_path_parser_finds_paths_only() -> None:
    text = "`rust/src/py/` and `python/ironlm/engine/kv/tier.py`, not `EngineClient`, `import ironlm` or `a/b`"
    assert named_paths(text) == ["python/ironlm/engine/kv/tier.py", "rust/src/py/"]


def test_the_package_the_architecture_describes_has_no_import_cycles() -> None:
    graph = import_graph()
    assert "ironlm.engine.kv.lifecycle" in graph and "ironlm.server.assemble" in graph
    assert find_cycles(graph) == []
