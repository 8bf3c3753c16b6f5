"""Package layering of rlf_envs and rlf_train, read from the source (no import, so no torch: it runs in the envs
env): the imports of both packages, at module level and inside functions alike (TYPE_CHECKING blocks included), form
no circle; rlf_envs never imports rlf_train; rlf_train's wings (`rollout/`, `policy/`) never import the learner on
top of them, and `policy/` never imports `rollout/`; nothing imports the modules kept only for old import paths; every
named error derives from `rlf_envs.errors.RlfError`; and shared data types flow one way (formats read `ToolSpec` from
`rlf_envs.types`, never from `rlf_envs.tools`)."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

from repo_paths import REPO

ROOT = REPO
SRCS = (ROOT / "rlf_envs" / "src", ROOT / "rlf_train" / "src")
OURS = ("rlf_envs", "rlf_verifiers", "rlf_train")

#: rlf_train's learner, on top of its wings
LEARNER = ("rlf_train.trainer", "rlf_train.grpo", "rlf_train.sft", "rlf_train.eval", "rlf_train.cli",
           "rlf_train.group_reward", "rlf_train.logging_utils", "rlf_train.openrlhf", "rlf_train.__main__")
#: modules kept for one release so that old import paths work: re-exports that nothing of ours may import
COMPAT = ("rlf_train.agent", "rlf_train.model", "rlf_train.vllm_engine", "rlf_train.endpoint", "rlf_train.view",
          "rlf_envs.adapters.episode")


#: exception classes outside the one root, and why: they run on a bare interpreter where rlf is not importable (the
#: sandbox's supervisor and in-session agent), or they are signals caught inside rlf, never raised to a caller
OUTSIDE_THE_ROOT = {
    "Deadline": "sandbox supervisor (bare interpreter; a BaseException, like KeyboardInterrupt)",
    "SolutionError": "sandbox supervisor (bare interpreter)",
    "SolutionDied": "sandbox supervisor (bare interpreter)",
    "SolutionRaised": "sandbox supervisor (bare interpreter)",
    "UserError": "the in-session agent (bare interpreter)",
    "LimitError": "the in-session agent (bare interpreter)",
    "ImageError": "sessions/images.py runs as a script on a bare interpreter",
    "OverBudget": "a signal between run_readonly_query_async and the SQL env, caught there",
    # still to join the root (the sandbox's files are another change's): a plain base class change each
    "DiffTooLarge": "sandbox/sessions/gitdiff.py",
    "PoolUnavailable": "sandbox/pool.py",
}


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for src in SRCS:
        for f in src.rglob("*.py"):
            parts = list(f.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = f
    return mods


def _import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports anywhere in its file (`from pkg import name` counts as pkg.name when
    that is a module, else as pkg)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            assert not (isinstance(node, ast.ImportFrom) and node.level), f"{name}: a relative import (use absolute)"
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    edges.add(target if target in mods else node.module)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    target = alias.name
                    while target not in mods and "." in target:
                        target = target.rpartition(".")[0]
                    if target.split(".")[0] in OURS:
                        edges.add(target)
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


def _within(mod: str, prefixes: tuple[str, ...]) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def test_no_import_cycles() -> None:
    graph = _import_graph()
    assert graph.get("rlf_envs.rewards.config")  # the walk sees module-level imports
    assert "rlf_train.policy.checkpoint" in graph["rlf_train.policy.load"]  # ... of both packages
    assert _cycles(graph) == []


def test_the_walk_sees_imports_inside_functions() -> None:
    graph = _import_graph()
    assert "rlf_train.rollout.env_source" in graph["rlf_train.rollout.source"]  # make_source imports it inside


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_rlf_envs_never_imports_rlf_train() -> None:
    graph = _import_graph()
    bad = {m: sorted(e for e in edges if _within(e, ("rlf_train",))) for m, edges in graph.items()
           if not _within(m, ("rlf_train",))}
    assert {m: e for m, e in bad.items() if e} == {}


def test_rlf_train_wings_stay_below_the_learner() -> None:
    graph = _import_graph()
    for mod, edges in graph.items():
        if _within(mod, ("rlf_train.rollout", "rlf_train.policy")):
            assert not {e for e in edges if _within(e, LEARNER)}, f"{mod} imports the learner"
        if _within(mod, ("rlf_train.policy",)):
            assert not {e for e in edges if _within(e, ("rlf_train.rollout",))}, f"{mod} imports rollout/"


def test_nothing_imports_the_old_paths() -> None:
    graph = _import_graph()
    for mod, edges in graph.items():
        if not _within(mod, COMPAT):
            assert not {e for e in edges if _within(e, COMPAT)}, f"{mod} imports a module kept for old paths"


def test_named_errors_share_one_root() -> None:
    """Every exception class of both packages derives from `RlfError` (through its bases, by name), but the private
    ones (`_Name`: control flow inside one module) and those listed, with their reason, in OUTSIDE_THE_ROOT."""
    bases: dict[str, set[str]] = {}
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                named = [b for b in node.bases if isinstance(b, ast.Name | ast.Attribute)]
                bases.setdefault(node.name, set()).update(b.id if isinstance(b, ast.Name) else b.attr for b in named)
    builtin_errors = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}

    def roots(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        if name in builtin_errors or name == "RlfError":
            return {name}
        return {r for b in bases.get(name, ()) if b not in seen for r in roots(b, seen | {name})}

    errors = {n for n in bases if roots(n) and n != "RlfError"}
    assert {"ConfigError", "SessionError", "ToolError", "EndpointError", "AgentFailed"} <= errors
    outside = {n for n in errors if "RlfError" not in roots(n) and not n.startswith("_")}
    assert outside == set(OUTSIDE_THE_ROOT), sorted(outside ^ set(OUTSIDE_THE_ROOT))


def test_formats_take_shared_types_from_types_not_tools() -> None:
    graph = _import_graph()
    for mod, edges in graph.items():
        if mod.startswith("rlf_envs.formats"):
            assert not {e for e in edges if e.startswith("rlf_envs.tools")}, mod
    from rlf_envs.tools.base import ToolSpec as FromTools
    from rlf_envs.types import ToolSpec

    assert FromTools is ToolSpec  # old import path keeps working
