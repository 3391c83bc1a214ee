"""No import cycles inside python/ironlm, read from the source with `ast` (nothing is imported).

Every import counts, including those inside functions and under `if TYPE_CHECKING:`: a lazy import
only hides a cycle until someone moves it to the top of the file. An edge goes to the most specific
module an import names (`from ironlm.engine import outputs` -> ironlm.engine.outputs when that is a
module, else ironlm.engine); importing a package's submodule does not add an edge to the package
itself, as that is always initialised first and cannot close a loop on its own.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "python"
PACKAGE = "ironlm"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def discover(root: Path, package: str) -> dict[str, Path]:
    """Module name -> source file, for every .py file of the package (generated gRPC code included).

    Extension modules (the Rust core) are leaves known by their stub or binary; they import nothing here.
    """
    found = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    for ext in ("*.pyi", "*.so", "*.pyd"):
        for p in (root / package).rglob(ext):
            leaf = p.with_name(p.name.split(".")[0] + ".py")
            found.setdefault(module_name(leaf, root), p)
    return found


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `module` imports anywhere in its source."""
    if path.suffix != ".py":
        return set()
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(module, is_package, node.level, node.module)
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {name for name in found if name in modules} - {module}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def import_graph(root: Path = PACKAGE_ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    modules = discover(root, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def test_package_has_no_import_cycles() -> None:
    graph = import_graph()
    assert "ironlm.engine.llm_engine" in graph  # the walk really reads the package
    cycles = find_cycles(graph)
    described = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles]
    assert not cycles, "import cycles in python/ironlm:\n" + "\n".join(described)


def test_checker_sees_lazy_and_relative_cycles(tmp_path: Path) -> None:
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from ironlm.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ironlm.a\n")
    (pkg / "d.py").write_text("from ironlm import a, sub\n")
    graph = import_graph(tmp_path, PACKAGE)
    assert graph["ironlm.a"] == {"ironlm.sub.b"}
    assert graph["ironlm.sub.b"] == {"ironlm.c"}
    assert graph["ironlm.d"] == {"ironlm.a", "ironlm.sub"}
    assert find_cycles(graph) == [["ironlm.a", "ironlm.c", "ironlm.sub.b"]]
    (pkg / "c.py").write_text("import os\n")
    assert find_cycles(import_graph(tmp_path, PACKAGE)) == []


def test_importing_the_package_and_engine_stays_light() -> None:
    """`import ironlm` and `ironlm.engine` do not load torch or transformers: LLMEngine and ModelRunner (the model
    side) load them on first use, so the light parts (configs, outputs, the engine protocols) stay cheap to import."""
    code = ("import sys, ironlm, ironlm.engine, ironlm.engine.protocol; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    code = "import sys; from ironlm.engine import LLMEngine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"  # the lazy name really resolves


def test_importing_the_core_loads_no_engine() -> None:
    """`import ironlm._core` runs `ironlm/__init__.py` first: the package root must not pull the engine in (its
    names load on first use), so the Rust core and the light config/exception modules come alone."""
    heavy = ("ironlm.engine", "ironlm.engine.async_engine", "ironlm.engine.outputs", "torch", "transformers")
    code = f"import sys, ironlm._core; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    # The lazy names still resolve, from the root and from the engine package.
    code = ("import sys, ironlm; from ironlm import RequestOutput; from ironlm.engine import AsyncLLMEngine; "
            "print(RequestOutput.__module__, AsyncLLMEngine.__module__, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["ironlm.engine.outputs", "ironlm.engine.async_engine", "False"]
