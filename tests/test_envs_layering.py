"""Package layering of rlf_envs: module-level imports form no cycle, and shared data types flow one way
(formats read `ToolSpec` from `rlf_envs.types`, never from `rlf_envs.tools`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.envs

SRC = Path(__file__).resolve().parents[1] / "rlf_envs" / "src"


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for f in SRC.rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _import_graph() -> dict[str, set[str]]:
    """Module -> rlf_envs modules it imports at module level (TYPE_CHECKING blocks included: a cycle there
    is still a cycle of the design; imports inside functions are deliberate lazy imports)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges: set[str] = set()
        body = ast.parse(path.read_text(encoding="utf-8")).body
        nodes = [n for stmt in body for n in (stmt.body if isinstance(stmt, ast.If) else [stmt])]
        for node in nodes:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rlf_envs"):
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    edges.add(target if target in mods else node.module)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name.startswith("rlf_envs"))
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    graph = _import_graph()
    assert graph.get("rlf_envs.rewards.config")  # the walk sees imports
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_formats_take_shared_types_from_types_not_tools() -> None:
    graph = _import_graph()
    for mod, edges in graph.items():
        if mod.startswith("rlf_envs.formats"):
            assert not {e for e in edges if e.startswith("rlf_envs.tools")}, mod
    from rlf_envs.tools.base import ToolSpec as FromTools
    from rlf_envs.types import ToolSpec

    assert FromTools is ToolSpec  # old import path keeps working
