"""rlf_envs.eval on rlf/Search-v0 (in-process BM25) through a loopback OpenAI-compatible server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlf_envs.eval import main
from rlf_envs.records import read_records, step_path

pytest.importorskip("openai", reason="rlf_envs.eval needs the openai client (rlf-envs[openai])")


def test_cli_on_search_r1_text_protocol(chat_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Search-R1 tags through a chat API (the server cuts the stop string off; we put it back)."""
    fake = chat_server(mode="search_r1")
    rc = main(["--env", "rlf/Search-v0", "--base-url", fake.url, "--model", "fake", "-n", "3", "--concurrency", "3",
               "--out", str(tmp_path), "--no-progress", "--env-kwargs", '{"split": "test"}'])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["episodes"] == 3
    assert fake.bodies[0]["stop"] == ["</search>", "</answer>"] and "tools" not in fake.bodies[0]
    r = read_records(step_path(tmp_path, 0))[0]
    assert r.turns[0].action.endswith("</search>") and r.turns[0].kind == "tool_calls"
    assert r.turns[0].results[0].status == "ok" and "<information>" in r.turns[0].observation
    assert r.turns[1].kind == "answer" and r.answer == "nobody knows"
