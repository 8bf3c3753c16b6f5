"""Trajectory records: a real episode (text and token mode) written as a JSON line and read back unchanged;
atomic writes; per-step files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlf_envs.envs.calculator import CalculatorEnv
from rlf_envs.records import (
    RecordError,
    TrajectoryRecord,
    append_step_records,
    list_steps,
    read_records,
    record_text_sample,
    step_path,
    write_records,
    write_trajectories,
)
from rlf_envs.types import Trajectory
from tests.envs.env.test_tool_env import make_tokenizer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
BAD = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 +"}}\n</tool_call>'


def episode(tokenizer: object = None) -> Trajectory:
    env = CalculatorEnv(num_tasks=3, tokenizer=tokenizer)
    env.reset(seed=0, options={"task_index": 1})
    expr = env.trajectory.task.question.removeprefix("What is ").removesuffix("?")
    env.step("not a call</x>\"<script>alert(1)</script>")  # invalid turn: corrective observation
    env.step(BAD)  # a tool error
    env.step(CALL % expr)
    answer = env.trajectory.turns[-1].results[0].content
    env.step(f"<answer>{answer}</answer>")
    return env.trajectory


@pytest.mark.parametrize("token_mode", [False, True])
def test_round_trip_of_a_real_episode(tmp_path: Path, token_mode: bool) -> None:
    traj = episode(make_tokenizer() if token_mode else None)
    rec = TrajectoryRecord.from_trajectory(traj, source="eval_greedy", step=7, index=3)
    assert [t.kind for t in rec.turns] == ["invalid", "tool_calls", "tool_calls", "answer"]
    assert rec.turns[0].error and rec.turns[0].observation
    assert rec.turns[1].results[0].status == "error" and rec.num_tool_errors == 1 and rec.num_tool_calls == 2
    assert rec.turns[2].tool_calls[0].name == "calculator" and rec.turns[2].results[0].latency_s >= 0
    assert rec.success and rec.reward == 1.0 and rec.end_reason == "answer" and rec.answer == traj.answer
    if token_mode:
        assert rec.token_ids == traj.token_ids and rec.loss_mask == traj.loss_mask
        s, e = rec.turns[2].action_span  # type: ignore[misc]
        assert set(rec.loss_mask[s:e]) == {1}  # type: ignore[index]
        s, e = rec.turns[2].observation_span  # type: ignore[misc]
        assert set(rec.loss_mask[s:e]) == {0}  # type: ignore[index]
    else:
        assert rec.token_ids is None and rec.loss_mask is None
    line = rec.to_json()
    assert "\n" not in line
    path = write_records(tmp_path / "x.jsonl", [rec, rec])
    back = read_records(path)
    assert back == [rec, rec]
    assert back[0].model_dump() == rec.model_dump()
    assert "<script>" in back[0].turns[0].action  # stored verbatim; escaping is the viewer's job
    assert "calculator" in record_text_sample(rec)


def test_bad_lines_name_the_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(TrajectoryRecord.from_trajectory(episode()).to_json() + "\n{\"nope\": 1}\n")
    with pytest.raises(RecordError, match=r"bad.jsonl:2"):
        read_records(p)


def test_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash while writing (in the middle of the records, or at the rename) leaves the old file intact and
    no temp file behind."""
    rec = TrajectoryRecord.from_trajectory(episode())
    path = write_records(tmp_path / "t" / "step_1.jsonl", [rec])
    before = path.read_bytes()
    new = [rec.model_copy(update={"index": i}) for i in range(1, 4)]
    calls = {"n": 0}
    real_to_json = TrajectoryRecord.to_json

    def fail_on_second(self: TrajectoryRecord) -> str:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("crash mid-write")
        return real_to_json(self)

    with monkeypatch.context() as m:
        m.setattr(TrajectoryRecord, "to_json", fail_on_second)
        with pytest.raises(RuntimeError, match="mid-write"):
            write_records(path, new)
    assert path.read_bytes() == before

    def boom(*a: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        write_records(path, new)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["step_1.jsonl"]


def test_step_files_replace_a_source_instead_of_duplicating(tmp_path: Path) -> None:
    trajs = [episode(), episode()]
    write_trajectories(tmp_path, 5, trajs, 8, "train")
    write_trajectories(tmp_path, 5, trajs, 1, "eval_greedy")
    write_trajectories(tmp_path, 5, trajs, 2, "eval_greedy")  # a resumed run writes the step again
    write_trajectories(tmp_path, 10, trajs, 0, "train")  # count 0: nothing
    recs = read_records(step_path(tmp_path, 5))
    assert sorted((r.source, r.index) for r in recs) == [("eval_greedy", 0), ("eval_greedy", 1),
                                                         ("train", 0), ("train", 1)]
    assert all(r.step == 5 for r in recs)
    append_step_records(tmp_path, 12, [TrajectoryRecord.from_trajectory(trajs[0], step=12)])
    assert [s for s, _ in list_steps(tmp_path)] == [5, 12]


def test_atomic_writes_get_the_mode_a_plain_write_gets(tmp_path: Path) -> None:
    """summary.json / eval.json were 0600 (mkstemp's mode) beside 0644 run files."""
    import os
    import stat

    from rlf_envs.records import atomic_write_text

    old = os.umask(0o022)
    try:
        for mask in (0o022, 0o027):
            os.umask(mask)
            plain = tmp_path / f"plain{mask:o}.txt"
            plain.write_text("x")
            atomic_write_text(tmp_path / f"atomic{mask:o}.json", "{}")
            mode = stat.S_IMODE((tmp_path / f"atomic{mask:o}.json").stat().st_mode)
            assert mode == stat.S_IMODE(plain.stat().st_mode) == 0o666 & ~mask
    finally:
        os.umask(old)
