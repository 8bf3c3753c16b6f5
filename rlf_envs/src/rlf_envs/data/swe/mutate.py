"""Realistic single-site bugs in real functions, by AST mutation (SWE-smith's "procedural" bugs).

`mutants(source, path)` lists every mutation site of a module's functions; `Mutant.apply(source)` rewrites only
the mutated node's source span (the rest of the file keeps its formatting, so the bug patch is a one- or
two-line diff) and checks that the new file parses to exactly the mutated tree.

Operators (`Mutant.op`): `compare` (flip a comparison: `<` / `<=`, `==` / `!=`, `in` / `not in`, `is` /
`is not`), `binop` (`+` / `-`, `*` / `//`...), `swap` (operands of a non-commutative operator), `off_by_one`
(an integer constant in a slice, a `range(...)` or an index, +-1), `negation` (drop a `not`), `boolop`
(`and` / `or`), `constant` (`True` / `False`, `0` / `1`), `early_return` (remove an `if ...: return`
guard that is not the function's last statement).
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

_CMP_FLIP: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
}
_BIN_FLIP: dict[type[ast.operator], type[ast.operator]] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.LShift: ast.RShift,
    ast.RShift: ast.LShift,
}
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod)


@dataclass(frozen=True, slots=True)
class Mutant:
    """One mutation: where (the function's qualified name and the node's span) and which operator."""

    path: str  # the module's path in the repository
    function: str  # qualified name, e.g. "LRUCache.popitem"
    op: str
    index: int  # the site's number in the module's walk order (stable for a given source)
    lineno: int
    end_lineno: int
    col: int
    end_col: int
    #: the new text of the span (for "early_return": "" and the span is whole lines)
    replacement: str
    #: the first line of the mutated function's code object (its first decorator, else its `def`)
    def_line: int = 0

    @property
    def key(self) -> str:
        return f"{self.path}:{self.function}:{self.op}:{self.index}"

    def apply(self, source: str) -> str:
        lines = source.splitlines(keepends=True)
        if self.op == "early_return":
            return "".join(lines[: self.lineno - 1] + lines[self.end_lineno:])
        # ast columns are UTF-8 byte offsets
        first = lines[self.lineno - 1].encode()
        last = lines[self.end_lineno - 1].encode()
        new = (first[: self.col] + self.replacement.encode() + last[self.end_col:]).decode()
        return "".join([*lines[:self.lineno - 1], new, *lines[self.end_lineno:]])


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield prefix + child.name, child
                yield from walk(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")

    yield from walk(tree, "")


def _own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function's body, not those of functions/classes nested in it (they are sites of their own)."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop(0)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        if isinstance(node, ast.arguments | ast.expr_context) or node in getattr(fn, "decorator_list", ()):
            continue
        yield node
        stack[0:0] = list(ast.iter_child_nodes(node))


def _is_docstring(node: ast.AST, fn: ast.AST) -> bool:
    body = getattr(fn, "body", [])
    return bool(body) and isinstance(body[0], ast.Expr) and body[0].value is node


def _variants(node: Any, parents: dict[ast.AST, ast.AST]) -> Iterator[tuple[str, ast.AST]]:
    """(operator, mutated copy of `node`) for every mutation of this node."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _CMP_FLIP:
                new = copy.deepcopy(node)
                new.ops[i] = _CMP_FLIP[type(op)]()
                yield "compare", new
    elif isinstance(node, ast.BinOp):
        if type(node.op) in _BIN_FLIP and not _is_string_format(node):
            flipped = copy.deepcopy(node)
            flipped.op = _BIN_FLIP[type(node.op)]()
            yield "binop", flipped
        if isinstance(node.op, _NON_COMMUTATIVE) and not _is_string_format(node):
            swapped = copy.deepcopy(node)
            swapped.left, swapped.right = swapped.right, swapped.left
            yield "swap", swapped
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "negation", copy.deepcopy(node.operand)
    elif isinstance(node, ast.BoolOp):
        other = copy.deepcopy(node)
        other.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield "boolop", other
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        yield "constant", ast.Constant(not node.value)
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        parent = parents.get(node)
        in_index = isinstance(parent, ast.Slice) or (isinstance(parent, ast.Subscript) and parent.slice is node)
        in_range = (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name)
                    and parent.func.id == "range" and node in parent.args)
        if isinstance(parent, ast.UnaryOp):  # -1 as an index: mutate the whole `-1`
            return
        if in_index or in_range:
            yield "off_by_one", ast.Constant(node.value + 1)
            if node.value > 0:
                yield "off_by_one", ast.Constant(node.value - 1)
        elif node.value in (0, 1) and isinstance(parent, ast.Return | ast.Assign | ast.Compare):
            yield "constant", ast.Constant(1 - node.value)


def _is_string_format(node: ast.BinOp) -> bool:
    return isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant) and isinstance(node.left.value, str)


def _early_returns(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.If]:
    for i, stmt in enumerate(fn.body[:-1]):
        if (isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1
                and isinstance(stmt.body[0], ast.Return | ast.Raise) and i + 1 < len(fn.body)):
            yield stmt


def mutants(source: str, path: str) -> list[Mutant]:
    """Every mutation site of the module's functions whose mutated source re-parses to the mutated tree."""
    tree = ast.parse(source)
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    out: list[Mutant] = []
    index = 0
    for qualname, fn in _functions(tree):
        first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
        for node in _own_nodes(fn):
            node = cast(Any, node)
            if not hasattr(node, "end_lineno") or _is_docstring(node, fn):
                continue
            for op, new in _variants(node, parents):
                index += 1
                m = Mutant(path, qualname, op, index, node.lineno, node.end_lineno or node.lineno,
                           node.col_offset, node.end_col_offset or 0, ast.unparse(new), first)
                if _checks(source, m, tree, node, new):
                    out.append(m)
        for guard in _early_returns(fn):
            index += 1
            m = Mutant(path, qualname, "early_return", index, guard.lineno, guard.end_lineno or guard.lineno,
                       0, 0, "", first)
            out.append(m)
    return [m for m in out if _reparses(source, m)]


def _checks(source: str, m: Mutant, tree: ast.Module, node: ast.AST, new: ast.AST) -> bool:
    """The mutated file parses to the original tree with `node` replaced by `new` (the span was right and no
    parentheses were lost)."""
    try:
        mutated = ast.parse(m.apply(source))
    except (SyntaxError, ValueError):
        return False
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    parent = parents.get(node)
    if parent is None:
        return False
    for field, value in ast.iter_fields(parent):
        if value is node:
            setattr(parent, field, new)
            try:
                return ast.dump(mutated) == ast.dump(tree)
            finally:
                setattr(parent, field, node)
        if isinstance(value, list) and any(v is node for v in value):
            k = next(i for i, v in enumerate(value) if v is node)
            value[k] = new
            try:
                return ast.dump(mutated) == ast.dump(tree)
            finally:
                value[k] = node
    return False


def _reparses(source: str, m: Mutant) -> bool:
    try:
        return ast.dump(ast.parse(m.apply(source))) != ast.dump(ast.parse(source))
    except (SyntaxError, ValueError):
        return False


__all__ = ["Mutant", "mutants"]
