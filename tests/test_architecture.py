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


# ---- the crate: modules named by `use` paths and inline `crate::`/`super::` paths -----------------------------------
RUST = ROOT / "rust" / "src"
_USE = re.compile(r"^\s*(?:pub(?:\([\w:]+\))?\s+)?use\s+([^;]+);", re.MULTILINE)
_INLINE = re.compile(r"\b((?:crate|super)(?:::\w+)+)")
_TEST_FILE = re.compile(r"(^|_)tests?\.rs$|^harness\.rs$|^test_rng\.rs$")


def _module_of(path: Path) -> tuple[str, ...]:
    parts = path.relative_to(RUST).with_suffix("").parts
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return ("crate", *parts)


def _expand_use(tree: str) -> list[str]:
    """`a::{b, c::{d as x, e}}` -> ['a::b', 'a::c::d', 'a::c::e'] (aliases dropped, globs kept)."""
    tree = re.sub(r"\s+", "", re.sub(r"\s+as\s+\w+", "", tree))
    if "{" not in tree:
        return [tree]
    head, body = tree.split("{", 1)
    body = body[: body.rindex("}")]
    items, depth, cur = [], 0, ""
    for ch in body + ",":
        if ch == "," and depth == 0:
            if cur:
                items.append(cur)
            cur = ""
            continue
        depth += (ch == "{") - (ch == "}")
        cur += ch
    return [p for item in items for p in _expand_use(head + item)]


def rust_module_graph() -> dict[str, set[str]]:
    """Non-test modules of rust/src and the modules each refers to, ancestors and descendants left out (a module
    and its submodules are one room)."""
    files = {p: _module_of(p) for p in RUST.rglob("*.rs") if not _TEST_FILE.search(p.name)}
    modules = set(files.values())
    graph: dict[str, set[str]] = {}
    for path, mod in files.items():
        text = path.read_text(encoding="utf-8")
        # Inline `#[cfg(test)] mod tests { ... }` blocks reach test-only modules: cut them off.
        text = text.split("#[cfg(test)]\nmod tests {", 1)[0]
        refs = [p for tree in _USE.findall(text) for p in _expand_use(tree)] + _INLINE.findall(text)
        deps = set()
        for ref in refs:
            segs = ref.split("::")
            if segs[0] == "super":
                segs = [*mod[:-1], *segs[1:]]
            elif segs[0] != "crate":
                continue
            target = max((m for m in modules if tuple(segs[: len(m)]) == m), key=len, default=None)
            if target is None or target[: len(mod)] == mod or mod[: len(target)] == target:
                continue
            deps.add("::".join(target))
        graph["::".join(mod)] = deps
    return graph


def test_the_crate_has_no_module_cycles() -> None:
    graph = rust_module_graph()
    # The checker sees the crate's real edges (it is not vacuous).
    assert "crate::cpu::attention" in graph["crate::cpu::decode"]
    assert "crate::sched::ord" in graph["crate::sched::queue"] and "crate::grammar" in graph["crate::sched::plan"]
    assert find_cycles(graph) == []
    # sched plans steps and never calls a kernel; the kernels know nothing of requests.
    assert not any(d.startswith("crate::cpu") for m, ds in graph.items() if m.startswith("crate::sched") for d in ds)
    assert not any(d.startswith("crate::sched") for m, ds in graph.items() if m.startswith("crate::cpu") for d in ds)


def test_the_rust_cycle_checker_sees_a_cycle() -> None:
    assert find_cycles({"crate::a": {"crate::b"}, "crate::b": {"crate::a"}, "crate::c": set()}) == [
        ["crate::a", "crate::b"]]


def test_use_trees_expand_to_paths() -> None:
    assert _expand_use("super::{act::{self, QActs}, Format as F, mask::Mask}") == [
        "super::act::self", "super::act::QActs", "super::Format", "super::mask::Mask"]
