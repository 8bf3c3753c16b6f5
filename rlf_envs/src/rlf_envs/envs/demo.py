"""`rlf/Tools-v0`: a ToolEnv with your tools and tasks; with neither, a small built-in demo.

The demo (`gym.make("rlf/Tools-v0")`): an invented census of eight towns, a `population` lookup tool and
the `calculator` tool; questions ask for one town's population or the sum of two (lookups, then
arithmetic, over several turns). No server, no download; the facts are invented, so only the tools know.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

from rlf_envs.env.tool_env import ToolEnv
from rlf_envs.envs.calculator import CALCULATOR
from rlf_envs.tools.base import ToolError
from rlf_envs.tools.python import FunctionTool
from rlf_envs.types import Task

TOWNS: dict[str, int] = {
    "Varnholt": 48_210, "Kessmoor": 9_875, "Lindqvar": 133_402, "Ostrevik": 27_516,
    "Bramsey Cove": 3_248, "Tolleran": 71_090, "Querrin": 15_733, "Eastmarch Fell": 502_114,
}


def population(town: str) -> str:
    """Population of a town at the last census.

    Args:
        town: the town's name, e.g. "Varnholt"
    """
    key = next((t for t in TOWNS if t.lower() == town.strip().lower()), None)
    if key is None:
        raise ToolError(f"no census record for {town!r}; known towns: {', '.join(TOWNS)}")
    return str(TOWNS[key])


POPULATION = FunctionTool(population, idempotent=True, inline=True)


def demo_tasks(seed: int = 0) -> list[Task]:
    """One question per town and one per pair of towns (36 in all), in a fixed shuffled order."""
    tasks = [Task(id=f"demo-pop-{t}", question=f"What is the population of {t}?", ground_truth=[str(n)])
             for t, n in TOWNS.items()]
    tasks += [
        Task(id=f"demo-sum-{a}-{b}", question=f"What is the combined population of {a} and {b}?",
             ground_truth=[str(TOWNS[a] + TOWNS[b])])
        for a, b in itertools.combinations(TOWNS, 2)
    ]
    random.Random(seed).shuffle(tasks)
    return tasks


class ToolsEnv(ToolEnv):
    """`ToolEnv` under the id `rlf/Tools-v0`. Without `tools`, `tasks`, `mcp_servers` or `toolbox`, it is
    the built-in demo (the `population` and `calculator` tools on `demo_tasks()`)."""

    def __init__(self, **kwargs: Any) -> None:
        if not any(kwargs.get(k) for k in ("tools", "tasks", "mcp_servers", "toolbox")):
            kwargs["tools"] = [POPULATION, CALCULATOR]
            kwargs["tasks"] = demo_tasks()
        super().__init__(**kwargs)
