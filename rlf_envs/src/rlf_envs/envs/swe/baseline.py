"""Scripted policies for rlf/SWE-v0 that prove the pipe end to end (tools -> workspace diff -> hidden tests).

`gold_actions(task)`: run the failing tests, apply the task's gold patch hunk by hunk with `edit` (a hunk whose old
text is not unique in the file falls back to `write_file` of the patch and `git apply`), run the tests again,
`submit()`. `harbor_oracle_actions(task_dir)`: upload the task's `solution/` with `write_file` and run `solve.sh`
with `bash` (Harbor's oracle, through the agent's own tools), then `submit()`. `python -m rlf_envs.envs.swe.baseline
--split test` runs the gold policy on the shipped split and prints the mean reward (1.0 expected).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from rlf_envs.envs.swe.tasks import SweTask, repo_for
from rlf_envs.envs.swe.verify import split_patch
from rlf_envs.types import Task


def tool_call(name: str, **arguments: Any) -> str:
    """A Qwen3/Hermes tool-call turn."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def hunks(file_diff: str) -> list[tuple[str, str]]:
    """(old text, new text) of each hunk of one file's diff."""
    out: list[tuple[str, str]] = []
    old: list[str] | None = None
    new: list[str] = []
    for line in file_diff.splitlines(keepends=True):
        if line.startswith("@@"):
            if old is not None:
                out.append(("".join(old), "".join(new)))
            old, new = [], []
        elif old is None:
            continue
        elif line.startswith("\\"):  # "\ No newline at end of file": the previous line had none
            for side in (old, new):
                if side and side[-1].endswith("\n"):
                    side[-1] = side[-1][:-1]
        elif line.startswith(" "):
            old.append(line[1:])
            new.append(line[1:])
        elif line.startswith("-"):
            old.append(line[1:])
        elif line.startswith("+"):
            new.append(line[1:])
    if old is not None:
        out.append(("".join(old), "".join(new)))
    return out


def _test_cmd(t: SweTask, tests: list[str]) -> str:
    return f"{t.test_cmd} " + " ".join(shlex.quote(x) for x in tests[:5]) + " 2>&1 | tail -15"


def gold_actions(task: Task) -> list[str]:
    """The scripted gold policy's turns for a SWE task."""
    t = SweTask.from_meta(task)
    repo = repo_for(t)
    actions = [tool_call("bash", command=_test_cmd(t, list(t.FAIL_TO_PASS)))]
    fallback = False
    for _, path, text in split_patch(t.patch):
        current = (repo / path).read_text(encoding="utf-8") if repo is not None and (repo / path).is_file() else None
        for old, new in hunks(text):
            if not old or current is None or current.count(old) != 1:
                fallback = True
                break
            actions.append(tool_call("edit", path=path, old=old, new=new))
    if fallback:
        actions = [actions[0], tool_call("write_file", path="/tmp/gold.patch", text=t.patch),
                   tool_call("bash", command="git apply /tmp/gold.patch && echo applied")]
    actions += [tool_call("bash", command=_test_cmd(t, [*t.FAIL_TO_PASS, *t.PASS_TO_PASS])), tool_call("submit")]
    return actions


def harbor_oracle_actions(task_dir: str) -> list[str]:
    """Harbor's oracle through the agent's tools: `solution/` uploaded to /tmp/.rlf_oracle, `solve.sh` run."""
    sol = Path(task_dir) / "solution"
    dest = "/tmp/.rlf_oracle"
    actions = []
    for f in sorted(sol.rglob("*")):
        if f.is_file():
            text = f.read_text(encoding="utf-8").replace("/solution/", dest + "/")
            actions.append(tool_call("write_file", path=f"{dest}/{f.relative_to(sol).as_posix()}", text=text))
    actions += [tool_call("bash", command=f"bash {dest}/solve.sh; echo done"), tool_call("submit")]
    return actions


def main(argv: list[str] | None = None) -> None:
    import gymnasium as gym

    import rlf_envs  # noqa: F401 - registers the ids

    ap = argparse.ArgumentParser(description="run the scripted gold policy on rlf/SWE-v0's shipped tasks")
    ap.add_argument("--split", default="test")
    ap.add_argument("--limit", type=int, default=0)
    args = ap.parse_args(argv)
    env: Any = gym.make("rlf/SWE-v0", split=args.split).unwrapped
    rewards: list[float] = []
    try:
        for i, task in enumerate(env.tasks[: args.limit or None]):
            env.reset(options={"task_index": i})
            for a in gold_actions(task):
                _, r, term, trunc, info = env.step(a)
                if term or trunc:
                    break
            rewards.append(float(r))
            print(f"{task.id}: {r}", flush=True)
    finally:
        env.close()
    print(f"mean reward {sum(rewards) / max(len(rewards), 1):.3f} over {len(rewards)} tasks")


if __name__ == "__main__":
    main()


__all__ = ["gold_actions", "harbor_oracle_actions", "hunks", "tool_call"]
