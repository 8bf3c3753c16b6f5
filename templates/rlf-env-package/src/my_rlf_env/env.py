"""`myenv/Arithmetic-v0`: "What is 12 + 7 * 3?" with a `calculator` tool; exact-match reward."""

from __future__ import annotations

import ast
import operator
import random
from typing import Any

from rlf_envs import Task, ToolEnv, ToolError

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return int(_OPS[type(node.op)](_eval(node.left), _eval(node.right)))
    raise ToolError("use integers with + - * and parentheses")


def calculator(expression: str) -> str:
    """Evaluate integer arithmetic.

    Args:
        expression: integers with + - * and parentheses, e.g. "12 + 7 * 3"
    """
    if len(expression) > 100:
        raise ToolError("expression longer than 100 characters")
    try:
        return str(_eval(ast.parse(expression.strip(), mode="eval").body))
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r}") from None


def arithmetic_tasks(n: int = 200, seed: int = 0) -> list[Task]:
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        expr = f"{a} + {b} * {c}"
        tasks.append(Task(id=f"arith-{i}", question=f"What is {expr}?", ground_truth=calculator(expr)))
    return tasks


class ArithmeticEnv(ToolEnv):
    """Any ToolEnv keyword (format, max_turns, tokenizer, verifier, ...) passes through."""

    def __init__(self, num_tasks: int = 200, seed: int = 0, **kwargs: Any) -> None:
        kwargs.setdefault("tasks", arithmetic_tasks(num_tasks, seed))
        super().__init__(tools=[calculator], **kwargs)
