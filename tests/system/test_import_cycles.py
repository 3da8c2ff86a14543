"""No module of ``pipeline`` takes part in an import cycle, type-only and function-level imports
included: a cycle held together by ``TYPE_CHECKING`` or a late import is still two modules
that cannot be understood (or moved) one without the other.

The graph is read from the source with :mod:`ast` (every ``import`` statement anywhere in a
module), so nothing is imported to build it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "pipeline"


def module_files() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_modules(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The ``pipeline`` modules that ``name`` imports anywhere in its body."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(name, is_package, node.module, node.level)
            for alias in node.names:
                if f"{base}.{alias.name}" in known:  # a submodule
                    yield f"{base}.{alias.name}"
                elif base in known:  # a name defined in that module or package
                    yield base


def _absolute(name: str, is_package: bool, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = name.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (level - 1)]
    return ".".join([*anchor, module] if module else anchor)


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: set(imported_modules(name, path, known)) - {name}
            for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: list[str] = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_cycle_and_ignores_a_chain() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_relative_imports_resolve_against_the_importing_module() -> None:
    assert _absolute("pipeline.core.log", False, "events", 1) == "pipeline.core.events"
    assert _absolute("pipeline.core", True, "events", 1) == "pipeline.core.events"
    assert _absolute("pipeline.core.log", False, None, 2) == "pipeline"


def test_the_graph_sees_type_only_and_function_level_imports() -> None:
    graph = import_graph()
    assert "pipeline.core.events" in graph["pipeline.core.log"]
    assert len(graph) > 100


def test_no_module_is_part_of_an_import_cycle() -> None:
    assert cycles(import_graph()) == []
