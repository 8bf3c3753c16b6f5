"""`rlf/Calculator-v0`: integer arithmetic questions and a `calculator` tool. No server needed."""

from __future__ import annotations

import ast
import operator
import random
from typing import Any

from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.tools.base import ToolError
from rlf_envs.tools.python import FunctionTool
from rlf_envs.types import Task

_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPR_CHARS = 200


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ToolError("exponent too large (limit: |exponent| <= 64, |base| <= 1e6)")
        try:
            return _OPS[type(node.op)](left, right)  # type: ignore[no-any-return]
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))  # type: ignore[no-any-return]
    raise ToolError(f"unsupported syntax {type(node).__name__}: use numbers, + - * / // % ** and parentheses")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: arithmetic using numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 12"
    """
    if len(expression) > MAX_EXPR_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r} as arithmetic") from None
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


CALCULATOR = FunctionTool(calculate, name="calculator", idempotent=True, inline=True)


def calculator_tasks(n: int = 500, seed: int = 0) -> list[Task]:
    """Deterministic integer arithmetic questions (two or three operands)."""
    rng = random.Random(seed)
    tasks: list[Task] = []
    for i in range(n):
        a, b, c = rng.randint(10, 999), rng.randint(10, 999), rng.randint(2, 99)
        form = rng.randrange(3)
        expr = [f"{a} * {b}", f"{a} * {b} + {c}", f"({a} + {b}) * {c}"][form]
        tasks.append(Task(id=f"calc-{seed}-{i}", question=f"What is {expr}?", ground_truth=[calculate(expr)]))
    return tasks


class CalculatorEnv(ToolEnv):
    """Arithmetic with a calculator tool; exact-match reward on the integer answer."""

    def __init__(self, num_tasks: int = 500, task_seed: int = 0, **kwargs: Any) -> None:
        kwargs.setdefault("tasks", calculator_tasks(num_tasks, task_seed))
        kwargs.setdefault("tools", [CALCULATOR])
        super().__init__(**kwargs)
