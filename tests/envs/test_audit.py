"""`python -m rlf_envs.audit`: scripted do-nothing, tampering and reference policies per task, and the tasks a
non-solution scores on (a hackable task is found; sound ones are not flagged)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gymnasium as gym

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs.audit import audit_env, summary
from rlf_envs.data.swe.generate import unified_diff


def test_a_code_task_a_non_answer_solves_is_flagged_and_sound_ones_are_not() -> None:
    tasks = [{"id": "sound", "question": "what is 6*7?", "ground_truth": "42", "meta": {"check": "numeric"}},
             {"id": "hole", "question": "say nothing", "ground_truth": "", "meta": {"check": "exact"}}]
    env = gym.make("rlf/Code-v0", tasks=tasks).unwrapped
    try:
        audits = {a.task_id: a for a in audit_env(env, progress=lambda s: None)}
    finally:
        env.close()
    assert audits["sound"].hackable_by == [] and audits["sound"].reference == 1.0
    assert "do_nothing" in audits["hole"].hackable_by
    s = summary(list(audits.values()))
    assert s["tasks"] == 2 and s["hackable"] == 1 and s["hackable_by_policy"]["do_nothing"] == 1


def test_a_swe_task_whose_failing_test_already_passes_is_flagged(tmp_path: Path) -> None:
    from session_support import need_sessions

    need_sessions()
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "m.py").write_text("X = 2\n")
    (repo / "test_m.py").write_text("from m import X\n\n\ndef test_x():\n    assert X == 2\n")
    row = {"instance_id": "already-fixed", "problem_statement": "X should be 2", "repo_dir": str(repo),
           "patch": unified_diff("m.py", "X = 2\n", "X = 2  # fixed\n"), "FAIL_TO_PASS": ["test_m.py::test_x"]}
    rows = tmp_path / "tasks.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    out = tmp_path / "audit.json"
    p = subprocess.run([sys.executable, "-m", "rlf_envs.audit", "--env", "rlf/SWE-v0", "--env-kwargs",
                        json.dumps({"task_file": str(rows)}), "--json", str(out)],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 1, p.stdout + p.stderr
    got = json.loads(out.read_text())
    task = got["tasks"][0]
    assert "do_nothing" in task["hackable_by"] and task["reference"] == 1.0
    # the tampering policies themselves score nothing on it beyond what doing nothing already gets
    assert task["rewards"]["write_reward"] == 1.0 and not task["history_visible"]
