"""rlf_envs.eval against a real OpenAI-compatible server on loopback (aiohttp), with the official `openai`
client on our side: native and text tool calls, a slow server, 500s, malformed tool calls."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import pytest

from rlf_envs.eval import EvalArgs, main, run_eval, strip_chat_markup
from rlf_envs.records import read_records, step_path
from tests.support.servers.fake_openai import FakeChatServer

pytest.importorskip("openai", reason="rlf_envs.eval needs the openai client (rlf-envs[openai])")


def calc_args(fake: FakeChatServer, out: Path, **kw: Any) -> EvalArgs:
    base: dict[str, Any] = dict(env="rlf/Calculator-v0", base_url=fake.url, model="fake", n=12, concurrency=4,
                                out=out, progress=False, request_timeout_s=10.0, max_retries=2)
    base.update(kw)
    return EvalArgs(**base)


@pytest.mark.parametrize("mode", ["native", "text"])
def test_tool_calls_native_and_text_solve_the_task(chat_server: Any, tmp_path: Path, mode: str) -> None:
    fake = chat_server(mode=mode)
    summary = run_eval(calc_args(fake, tmp_path))
    assert summary.episodes == 12 and summary.success_rate == 1.0 and summary.policy_errors == 0
    assert summary.tool_calls_mean == 1.0 and summary.requests == 24
    assert summary.prompt_tokens == 24 * 10 and summary.completion_tokens == 24 * 5
    recs = read_records(step_path(tmp_path, 0))
    assert [r.index for r in recs] == list(range(12)) and all(r.source == "api_eval" for r in recs)
    r0 = recs[0]
    assert r0.turns[0].kind == "tool_calls" and r0.turns[0].results[0].status == "ok"
    assert r0.turns[0].results[0].latency_s >= 0 and r0.end_reason == "answer" and r0.success
    assert json.loads((tmp_path / "summary.json").read_text())["success_rate"] == 1.0
    first = fake.bodies[0]
    if mode == "native":  # the env's tools go to the API; the result comes back as a `tool` message
        assert first["tools"][0]["function"]["name"] == "calculator"
        second = next(b for b in fake.bodies if len(b["messages"]) > 1)
        assert second["messages"][-1]["role"] == "tool"
        assert second["messages"][-1]["tool_call_id"] == second["messages"][-2]["tool_calls"][0]["id"]
    assert "<|im_start|>" not in json.dumps(fake.bodies)  # no ChatML markup sent to a chat API


def test_malformed_tool_calls_get_the_envs_correction(chat_server: Any, tmp_path: Path) -> None:
    fake = chat_server(mode="malformed")
    summary = run_eval(calc_args(fake, tmp_path, n=4))
    assert summary.invalid_turns == 4 and summary.success_rate == 1.0 and summary.policy_errors == 0
    r = read_records(step_path(tmp_path, 0))[0]
    assert r.turns[0].kind == "invalid" and "not JSON" in (r.turns[0].error or "")
    assert [t.kind for t in r.turns] == ["invalid", "tool_calls", "answer"]
    retry = next(b for b in fake.bodies if any("invalid" in (m.get("content") or "") for m in b["messages"]))
    assert retry["messages"][-1]["role"] == "user" and "not JSON" in retry["messages"][-1]["content"]


def test_500s_are_retried_within_the_bound(chat_server: Any, tmp_path: Path) -> None:
    fake = chat_server(error_first=2)
    summary = run_eval(calc_args(fake, tmp_path, n=6, concurrency=2))
    assert fake.errors_sent == 2 * summary.requests and summary.success_rate == 1.0 and summary.policy_errors == 0


def test_a_server_that_always_fails_gives_policy_errors_not_a_crash(chat_server: Any, tmp_path: Path) -> None:
    fake = chat_server(always_error=True)
    summary = run_eval(calc_args(fake, tmp_path, n=3, concurrency=3, max_retries=1))
    assert summary.policy_errors == 3 and summary.success_rate == 0.0
    assert fake.requests == 3 * 2  # one try + one retry each: bounded
    recs = read_records(step_path(tmp_path, 0))
    assert all(r.end_reason == "policy_error" and "InternalServerError" in (r.error or "") for r in recs)


def test_slow_requests_hit_the_deadline_and_are_retried(chat_server: Any, tmp_path: Path) -> None:
    fake = chat_server(slow_first=1, delay_s=30.0)
    summary = run_eval(calc_args(fake, tmp_path, n=6, concurrency=3, request_timeout_s=1.0, max_retries=3))
    assert fake.slow_sent == summary.requests and summary.success_rate == 1.0 and summary.policy_errors == 0


def test_episode_deadline_fires_on_a_server_that_never_answers(chat_server: Any, tmp_path: Path) -> None:
    fake = chat_server(always_slow=True, delay_s=60.0)
    t0 = time.perf_counter()
    summary = run_eval(calc_args(fake, tmp_path, n=2, concurrency=2, request_timeout_s=30.0,
                                 episode_timeout_s=1.0))
    assert time.perf_counter() - t0 < 25  # generous: the 1 s episode deadline fired, not the 30 s request one
    assert summary.policy_errors == 2
    assert all("deadline" in (r.error or "") for r in read_records(step_path(tmp_path, 0)))


def test_progress_lines_when_not_a_tty(chat_server: Any, tmp_path: Path) -> None:
    from rlf_envs import runtime
    from rlf_envs.eval import evaluate

    fake = chat_server()
    stream = io.StringIO()
    args = calc_args(fake, tmp_path, n=5, progress=True)
    runtime.run(evaluate(args, stream))
    lines = stream.getvalue().splitlines()
    assert lines and "\r" not in stream.getvalue() and lines[-1].startswith("5/5 episodes")


def test_strip_chat_markup() -> None:
    text = "<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert strip_chat_markup(text) == "<tool_response>\n4\n</tool_response>"
    assert strip_chat_markup("<|im_start|>assistant\n<think>\n\n</think>\n\n") == ""


def test_cli_rejects_bad_env_kwargs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--env", "rlf/Calculator-v0", "--base-url", "http://127.0.0.1:9/v1", "--model", "m",
              "--env-kwargs", "[1]"])
    assert "JSON object" in capsys.readouterr().err


def _dead_url() -> str:
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_cli_exits_1_when_every_episode_failed_on_the_endpoint(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--env", "rlf/Calculator-v0", "--base-url", _dead_url(), "--model", "m", "-n", "4", "--concurrency",
               "2", "--max-retries", "0", "--request-timeout", "5", "--out", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err[-1].startswith("error: all 4 episodes failed on the policy endpoint") and "APIConnectionError" in err[-1]
    summary = json.loads((tmp_path / "summary.json").read_text())  # the files are written all the same
    assert summary["policy_errors"] == 4 and len(read_records(step_path(tmp_path, 0))) == 4


def test_cli_exits_0_when_episodes_ran(chat_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = chat_server()
    assert main(["--env", "rlf/Calculator-v0", "--base-url", fake.url, "--model", "fake", "-n", "2",
                 "--out", str(tmp_path), "--no-progress"]) == 0
    assert "error" not in capsys.readouterr().err


def test_cli_misspelt_env_kwarg_is_one_line_before_any_request(capsys: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    rc = main(["--env", "rlf/Search-v0", "--base-url", _dead_url(), "--model", "m", "--env-kwargs",
               '{"splt": "test"}', "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "Traceback" not in err
    assert err.startswith("error: --env-kwargs: 'splt' is not an option of rlf/Search-v0 (did you mean 'split'?)")
    assert not (tmp_path / "out").exists()
    assert main(["--env", "rlf/Serch-v0", "--base-url", _dead_url(), "--model", "m"]) == 2
    assert "did you mean rlf/Search-v0" in capsys.readouterr().err


def test_help_says_what_counts_as_failure(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "exit status:" in out and "every episode failed on infrastructure" in out and "--episode-timeout" in out


def test_an_existing_eval_dir_is_not_overwritten_without_asking(tmp_path: Path) -> None:
    from rlf_envs.eval import EvalArgs, run_eval

    out = tmp_path / "eval"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match="already holds an eval.*--overwrite"):
        run_eval(EvalArgs(env="rlf/Calculator-v0", base_url="http://127.0.0.1:9/v1", model="m", n=1, out=out))
    assert (out / "summary.json").read_text() == "{}"
