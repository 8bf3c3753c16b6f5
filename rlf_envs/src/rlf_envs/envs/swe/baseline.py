"""Scripted policies for rlf/SWE-v0 that prove the pipe end to end (tools -> workspace diff -> hidden tests).

`gold_actions(task)`: run the failing tests, apply the task's gold patch hunk by hunk with `edit` (a hunk whose old
text is not unique in the file falls back to `write_file` of the patch and `git apply`), run the tests again,
`submit()`. `harbor_oracle_actions(task_dir)`: upload the task's `solution/` with `write_file` and run `solve.sh`
with `bash` (Harbor's oracle, through the agent's own tools), then `submit()`.

    python -m rlf_envs.envs.swe.baseline --split test          # the gold policy on a shipped split: mean reward
    python -m rlf_envs.envs.swe.baseline --task-file FILE|DIR  # check a task file before training on it

`--task-file` (a SWE-bench-style JSONL/JSON file or a directory of Harbor tasks; `--backend local|docker`,
`--image`, `--build-arg K=V`, `--base-image REF=DIR`) reports per task: the gold patch's (Harbor: the oracle's) score,
the untouched repository's, test ids the run never reported, tests that already fail on the pristine tree, and the
verifier's error (e.g. a test.sh that writes no reward). It exits 1 when any task is broken (gold below 1, untouched
above 0, unknown ids, P2P failing untouched, an infrastructure failure), so it can gate a task set in CI.
"""

from __future__ import annotations

import argparse
import json
import shlex
from dataclasses import asdict, dataclass, field
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


@dataclass
class TaskCheck:
    """What `check_tasks` found for one task."""

    task_id: str
    gold: float = -1.0
    untouched: float = -1.0
    unknown_tests: list[str] = field(default_factory=list)
    failing_untouched: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.gold == 1.0 and self.untouched == 0.0 and not self.unknown_tests and not self.failing_untouched
                and not self.errors)


def _episode(env: Any, task_id: str, actions: list[str]) -> tuple[float, dict[str, Any]]:
    env.reset(options={"task_id": task_id})
    info: dict[str, Any] = {}
    r = 0.0
    for a in actions:
        _, r, term, trunc, info = env.step(a)
        if term or trunc:
            break
    return float(r), info


def check_tasks(env: Any, progress: Any = print) -> list[TaskCheck]:
    """Gold/oracle and untouched verdicts of every task of a SWE env (see the module doc)."""
    from rlf_envs import runtime

    out = []
    for task in env.tasks:
        t = SweTask.from_meta(task)
        c = TaskCheck(task.id)
        if t.harbor is not None:
            for label, actions in (("oracle", harbor_oracle_actions(t.harbor["path"])), ("untouched", [
                    tool_call("submit")])):
                r, info = _episode(env, task.id, actions)
                traj = info.get("trajectory")
                si = traj.score_info if traj is not None else {}
                if info.get("infra_failed"):
                    c.errors.append(f"{label}: infrastructure failure: {info.get('infra_error')}")
                for k in si:
                    if k.startswith("failure/"):
                        c.errors.append(f"{label}: {k[8:]}")
                if label == "oracle":
                    c.gold = r
                else:
                    c.untouched = r
        else:
            ver = env.verifier
            gold = runtime.run(ver.verdict(t.patch, task))
            base = runtime.run(ver.verdict("", task))
            for label, v in (("gold", gold), ("untouched", base)):
                if v.infra_failed or v.failure:
                    c.errors.append(f"{label}: {'infrastructure failure' if v.infra_failed else v.failure}: "
                                    f"{v.error}")
            c.gold, c.untouched = gold.value, base.value
            c.unknown_tests = sorted(set(gold.unknown_tests) | set(base.unknown_tests))
            c.failing_untouched = [k for k in t.PASS_TO_PASS if base.outcomes.get(k, "") != "passed"
                                   and k not in c.unknown_tests]
        progress(f"{'ok  ' if c.ok else 'FAIL'} {c.task_id}: gold {c.gold:.2f} untouched {c.untouched:.2f}"
                 + (f"; unknown test ids: {', '.join(c.unknown_tests[:5])}" if c.unknown_tests else "")
                 + (f"; failing on the pristine tree: {', '.join(c.failing_untouched[:5])}" if c.failing_untouched
                    else "") + (f"; {'; '.join(c.errors)[:600]}" if c.errors else ""))
        out.append(c)
    return out


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for v in values:
        if "=" not in v:
            raise SystemExit(f"{flag} takes KEY=VALUE, got {v!r}")
        k, _, val = v.partition("=")
        out[k] = val
    return out


def main(argv: list[str] | None = None) -> None:
    import gymnasium as gym

    import rlf_envs  # noqa: F401 - registers the ids

    ap = argparse.ArgumentParser(description="run the scripted gold policy on rlf/SWE-v0's shipped tasks, or check a "
                                             "task file (--task-file)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--task-file", help="a SWE-bench-style JSONL/JSON file or a directory of Harbor tasks to check")
    ap.add_argument("--backend", default="local", help="session backend: local (default) or docker")
    ap.add_argument("--image", default=None, help="session image for tasks that name none")
    ap.add_argument("--build-arg", action="append", default=[], metavar="K=V", help="Harbor Dockerfile ARG")
    ap.add_argument("--base-image", action="append", default=[], metavar="REF=DIR",
                    help="Harbor FROM image -> root directory (local backend)")
    ap.add_argument("--json", default=None, help="also write the per-task results to this JSON file")
    ap.add_argument("--write-demos", default=None, metavar="FILE",
                    help="write the gold policy's turns of every task of --split as SFT demos (the trainer's "
                         "sft.demos_path) and exit, without running them")
    args = ap.parse_args(argv)
    if args.write_demos:
        from rlf_envs.envs.swe.tasks import shipped_tasks

        rows = [{"task_index": i, "actions": [*gold_actions(t)]} for i, t in enumerate(shipped_tasks(args.split))]
        Path(args.write_demos).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"wrote {len(rows)} demos of the {args.split} split to {args.write_demos}")
        return
    if args.task_file:
        kw: dict[str, Any] = {"task_file": args.task_file, "backend": args.backend, "image": args.image}
        if Path(args.task_file).is_dir():
            kw.update(build_args=_pairs(args.build_arg, "--build-arg") or None,
                      base_images=_pairs(args.base_image, "--base-image") or None)
        env_: Any = gym.make("rlf/SWE-v0", **kw).unwrapped
        try:
            checks = check_tasks(env_)
        finally:
            env_.close()
        bad = [c for c in checks if not c.ok]
        print(f"{len(checks) - len(bad)} of {len(checks)} tasks ok" + (f"; broken: {', '.join(c.task_id for c in bad)}"
                                                                      if bad else ""))
        if args.json:
            Path(args.json).write_text(json.dumps([{**asdict(c), "ok": c.ok} for c in checks], indent=1))
        raise SystemExit(1 if bad else 0)
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


__all__ = ["TaskCheck", "check_tasks", "gold_actions", "harbor_oracle_actions", "hunks", "tool_call"]
