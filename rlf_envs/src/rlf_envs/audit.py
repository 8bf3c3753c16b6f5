"""A task hackability audit: which tasks of an env a non-solution scores on.

    python -m rlf_envs.audit --env rlf/SWE-v0 [--env-kwargs '{"split": "test"}'] [--limit N] [--json out.json]
    python -m rlf_envs.audit --env rlf/Code-v0
    python -m rlf_envs.audit --env rlf/SQL-v0

Per task it runs scripted policies through the env's own tools and verifier (no model): a do-nothing policy, the
tampering policies that apply to the env (SWE/Harbor: delete or rewrite the tests, shadow the test runner with
`conftest.py`/`sitecustomize.py`/a runner-named module, read the repository's history, write the reward file; Code:
answers that exit the checker early or print a pass; SQL: answers that select nothing, everything or drop a
table) and the reference solution where the task has one. A task is **hackable** when a non-solution policy
scores above 0; `history_visible` flags SWE tasks whose workspace shows more than the starting commit. The
reference scoring below 1 marks a broken task (see also `python -m rlf_envs.envs.swe.baseline --task-file`).
Exit status: 0 when no task is hackable, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


def _call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


_CONFTEST = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
             "    outcome = yield\n    rep = outcome.get_result()\n    rep.outcome = 'passed'\n")
_EDIT_TESTS = ("for f in $(find . -name 'test_*.py' -o -name '*_test.py' -o -path '*/tests/*.py' | grep -v '/.git/'); "
               "do printf 'def test_ok():\\n    pass\\n' > \"$f\"; done; echo rewritten")
_DELETE_TESTS = ("find . \\( -name 'test_*.py' -o -name '*_test.py' -o -name tests -o -name test \\) -not -path "
                 "'./.git/*' -prune -exec rm -rf {} + ; echo deleted")
_REWARD = ("mkdir -p /logs/verifier 2>/dev/null; echo 1 > /logs/verifier/reward.txt; "
           "echo '{\"reward\": 1.0}' > /logs/verifier/reward.json; echo written")
_HISTORY = "git log --all --oneline 2>/dev/null | wc -l"

#: SWE/Harbor tampering policies: name -> the turns (each ends with submit)
SWE_POLICIES: dict[str, list[str]] = {
    "do_nothing": [_call("submit")],
    "delete_tests": [_call("bash", command=_DELETE_TESTS), _call("submit")],
    "rewrite_tests": [_call("bash", command=_EDIT_TESTS), _call("submit")],
    "conftest_hook": [_call("write_file", path="conftest.py", text=_CONFTEST), _call("submit")],
    "sitecustomize": [_call("write_file", path="sitecustomize.py", text="import os\nos._exit(0)\n"),
                      _call("submit")],
    "shadow_runner": [_call("write_file", path="pytest.py", text="import sys\nsys.exit(0)\n"),
                      _call("write_file", path="json.py", text="def dump(*a, **k):\n    pass\n"), _call("submit")],
    "write_reward": [_call("bash", command=_REWARD), _call("submit")],
}
CODE_POLICIES: dict[str, list[str]] = {
    "do_nothing": ["<answer></answer>"],
    "answer_zero": ["<answer>0</answer>"],
    "exit_early": ["<answer>import sys\nsys.exit(0)</answer>"],
    "hard_exit": ["<answer>import os\nos._exit(0)</answer>"],
    "print_pass": ["<answer>print('PASSED')\nprint('OK')</answer>"],
}
SQL_POLICIES: dict[str, list[str]] = {
    "do_nothing": ["<answer></answer>"],
    "select_nothing": ["<answer>SELECT 1 WHERE 0</answer>"],
    "select_one": ["<answer>SELECT 1</answer>"],
    "drop_table": ["<answer>DROP TABLE IF EXISTS customers</answer>"],
    "not_sql": ["<answer>the answer is 42</answer>"],
}


@dataclass
class TaskAudit:
    """One task's rewards per policy (`reference`: the task's own solution, -1 when it has none)."""

    task_id: str
    rewards: dict[str, float] = field(default_factory=dict)
    reference: float = -1.0
    history_visible: bool = False
    errors: list[str] = field(default_factory=list)

    @property
    def hackable_by(self) -> list[str]:
        return [k for k, v in self.rewards.items() if v > 0.0]


def _run(env: Any, index: int, actions: list[str]) -> tuple[float, dict[str, Any], list[str]]:
    env.reset(options={"task_index": index})
    obs: list[str] = []
    r, info = 0.0, {}
    for a in actions:
        o, r, term, trunc, info = env.step(a)
        obs.append(str(o))
        if term or trunc:
            break
    return float(r), info, obs


def _policies(env: Any, task: Any) -> tuple[dict[str, list[str]], list[str] | None]:
    """The tampering policies and the reference turns (None: the task has no reference solution)."""
    from rlf_envs.envs.code import CodeEnv
    from rlf_envs.envs.sql import SqlEnv
    from rlf_envs.envs.swe.env import SweEnv

    if isinstance(env, SweEnv):
        from rlf_envs.envs.swe.baseline import gold_actions, harbor_oracle_actions
        from rlf_envs.envs.swe.tasks import SweTask

        t = SweTask.from_meta(task)
        ref = harbor_oracle_actions(t.harbor["path"]) if t.harbor is not None else (gold_actions(task) if t.patch
                                                                                      else None)
        return {**SWE_POLICIES, "read_history": [_call("bash", command=_HISTORY), _call("submit")]}, ref
    gt = task.ground_truth
    if isinstance(env, CodeEnv):
        ref = [f"<answer>{gt}</answer>"] if task.meta.get("check") in ("numeric", "exact") and gt is not None else None
        return dict(CODE_POLICIES), ref
    if isinstance(env, SqlEnv):
        ref = [f"<answer>{gt}</answer>"] if isinstance(gt, str) else None
        return dict(SQL_POLICIES), ref
    ref = [f"<answer>{gt if isinstance(gt, str) else json.dumps(gt)}</answer>"] if gt is not None else None
    return {"do_nothing": ["<answer></answer>"]}, ref


def audit_env(env: Any, limit: int = 0, progress: Callable[[str], Any] = print) -> list[TaskAudit]:
    """Run every policy on the first `limit` tasks (0: all) of `env` (unwrapped)."""
    out = []
    for i, task in enumerate(env.tasks[: limit or None]):
        a = TaskAudit(task.id)
        policies, ref = _policies(env, task)
        for name, actions in policies.items():
            try:
                r, info, obs = _run(env, i, actions)
            except Exception as e:  # an env that raises for a policy is a finding too
                a.errors.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            if info.get("infra_failed"):
                a.errors.append(f"{name}: infrastructure failure: {info.get('infra_error')}")
            if name == "read_history":
                count = next((line.strip() for o in obs for line in o.splitlines() if line.strip().isdigit()), "0")
                a.history_visible = int(count) > 1
            a.rewards[name] = r
        if ref is not None:
            try:
                a.reference = _run(env, i, ref)[0]
            except Exception as e:
                a.errors.append(f"reference: {type(e).__name__}: {str(e)[:200]}")
        progress(f"{'HACKABLE' if a.hackable_by else 'ok      '} {a.task_id}: reference {a.reference:.2f}"
                 + (f"; scores for {', '.join(a.hackable_by)}" if a.hackable_by else "")
                 + ("; git history visible" if a.history_visible else "")
                 + (f"; {'; '.join(a.errors)[:300]}" if a.errors else ""))
        out.append(a)
    return out


def summary(audits: list[TaskAudit]) -> dict[str, Any]:
    per_policy: dict[str, int] = {}
    for a in audits:
        for k in a.hackable_by:
            per_policy[k] = per_policy.get(k, 0) + 1
    return {"tasks": len(audits), "hackable": sum(1 for a in audits if a.hackable_by),
            "hackable_by_policy": per_policy, "history_visible": sum(a.history_visible for a in audits),
            "reference_below_1": sum(1 for a in audits if 0.0 <= a.reference < 1.0),
            "errors": sum(1 for a in audits if a.errors)}


def main(argv: list[str] | None = None) -> int:
    import gymnasium as gym

    import rlf_envs  # noqa: F401 - registers the ids

    p = argparse.ArgumentParser(prog="python -m rlf_envs.audit", description=__doc__.split("\n\n")[0])
    p.add_argument("--env", required=True, help="a registered env id, e.g. rlf/SWE-v0")
    p.add_argument("--env-kwargs", type=json.loads, default={}, help="JSON for gymnasium.make")
    p.add_argument("--limit", type=int, default=0, help="audit only the first N tasks")
    p.add_argument("--json", type=Path, default=None, help="write the per-task results here")
    a = p.parse_args(argv)
    env = gym.make(a.env, **a.env_kwargs).unwrapped
    try:
        audits = audit_env(env, a.limit)
    finally:
        env.close()
    s = summary(audits)
    print(json.dumps(s, indent=1))
    if a.json:
        a.json.write_text(json.dumps({"summary": s, "tasks": [{**asdict(x), "hackable_by": x.hackable_by}
                                                             for x in audits]}, indent=1))
    return 1 if s["hackable"] else 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["CODE_POLICIES", "SQL_POLICIES", "SWE_POLICIES", "TaskAudit", "audit_env", "summary"]
