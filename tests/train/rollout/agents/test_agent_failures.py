"""An agent that misbehaves cannot hang or silently spoil a run (issue 42, items 1, 4, 11):

- an `async def` agent that blocks its event loop (time.sleep) is timed out at `rollout.agent_timeout_s`,
  detected (`agent_blocked`) and counted, and the runner closes in bounded time;
- a real `python -m rlf_train` run whose agent blocks forever stops promptly on SIGINT (exit 130, a resume
  hint), without a second hang while closing;
- failures are loud: a console line as they happen, an end-of-run summary, exit 1 when every episode of an
  update failed, and eval rows carry the agent's counters;
- an `AgentResult`'s own reward is taken whatever its value (0.0 does not fall through to the verifier).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from repo_paths import SUPPORT

from rlf_envs.types import Task
from rlf_train.cli import main
from rlf_train.config import dump_config
from rlf_train.rollout.agent_runner import AgentResult
from tests.train.rollout.agents.test_agent_train import agent_cfg, ask, run_agent

HERE = SUPPORT


def test_a_blocking_agent_is_timed_out_detected_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    stop = threading.Event()
    unblock = threading.Timer(60.0, stop.set)  # (so a runner that waits for the agent fails here, not hangs)
    unblock.start()

    async def blocker(task: Task, client: Any) -> None:
        await ask(client)
        while not stop.is_set():
            time.sleep(0.05)  # blocks its event loop: no await

    t0 = time.monotonic()
    try:
        eps = run_agent(blocker, timeout_s=3.0)
    finally:
        stop.set()
        unblock.cancel()
    elapsed = time.monotonic() - t0
    assert eps.rewards == [0.0] and eps.stats.timeouts == 1 and eps.stats.blocked == 1, eps.stats
    assert elapsed < 45, f"the blocked episode took {elapsed:.0f} s to end; its timeout is 3 s"
    assert len(eps.trajectories) == 1  # the reply it got before blocking is still recorded
    assert "event loop has not turned" in caplog.text and "agent_timeout_s" in caplog.text


def test_ctrl_c_stops_a_run_whose_agent_blocks_forever(tmp_path: Path) -> None:
    marker = tmp_path / "blocking"
    agent = tmp_path / "blocking_agent.py"
    agent.write_text(f'''
import time
from pathlib import Path


async def agent(task, client):
    await client.chat.completions.create(model=client.model, messages=[{{"role": "user", "content": "q"}}])
    Path({str(marker)!r}).write_text("blocking")
    while True:
        time.sleep(0.05)
''')
    run = tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(dump_config(agent_cfg(run, [f"rollout.agent={agent}:agent", "rollout.agent_timeout_s=600",
                                               "eval.before_rl=false", "algorithm.steps=1"])))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    # (SIGINT reset to its default in the child: a shell's background job, as tox may be, inherits it ignored)
    proc = subprocess.Popen([sys.executable, "-m", "rlf_train", "--config", str(cfg)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.exists(), f"the agent never ran: {proc.poll()} {proc.stderr.read() if proc.stderr else ''}"
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert "interrupted" in err and f"--resume {run}" in err
    assert took < 60, f"the run took {took:.0f} s to stop after SIGINT"
    assert "agent: training" in out  # the summary is printed on the way out too


async def always_raises(task: Task, client: Any) -> None:
    await ask(client)
    raise ValueError("the agent's own bug")


def test_every_episode_failing_exits_1_with_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))
    run = tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(dump_config(agent_cfg(run, [f"rollout.agent={Path(__file__)}:always_raises",
                                               "eval.before_rl=true"])))
    assert main(["--config", str(cfg)]) == 1
    got = capsys.readouterr()
    assert "every one of the 8 agent episodes of this update failed (8 raised, 0 timed out" in got.err
    assert "agent: training 8 agent episodes: 8 errors" in got.out
    # the eval before RL ran (and failed the same way, counted in its row, not stopping the run)
    evals = json.loads((run / "eval.json").read_text())["evals"]
    assert evals[0]["greedy"]["agent_errors"] == 2.0 and evals[0]["greedy"]["agent_timeouts"] == 0.0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["agent_errors_greedy"] for r in rows if r["stage"] == "eval"] == [2.0]


async def half_fail(task: Task, client: Any) -> float:
    r = await ask(client)
    if int(task.id.split("-")[1]) % 2:
        raise ValueError("odd tasks fail")
    return float(len(r.choices[0].message.content or "") % 2)


def test_errors_are_reported_as_they_happen_and_summarised(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(dump_config(agent_cfg(run, [f"rollout.agent={Path(__file__)}:half_fail"])))
    sys.path.insert(0, str(HERE))
    try:
        assert main(["--config", str(cfg)]) == 0  # some episodes of each update succeeded: the run goes on
    finally:
        sys.path.remove(str(HERE))
    out = capsys.readouterr().out
    assert "odd tasks fail" in caplog.text  # the first traceback, as it happened
    line = next(x for x in out.splitlines() if x.startswith("agent: training"))
    n_err = sum(json.loads(x).get("agent_errors", 0) for x in (run / "metrics.jsonl").read_text().splitlines()
                if json.loads(x)["stage"] == "rl")
    assert n_err > 0 and f"16 agent episodes: {int(n_err)} errors" in line, line


@pytest.mark.parametrize("result, reward", [
    (AgentResult(answer="Vell", reward=0.0), 0.0),  # the verifier would give 1.0
    (AgentResult(answer="Paris", reward=1.0), 1.0),  # ... and 0.0 here
    (0.0, 0.0), (0, 0.0), (AgentResult(reward=-1.0), -1.0),
])
def test_an_agents_own_reward_is_taken_whatever_its_value(result: Any, reward: float) -> None:
    async def agent(task: Task, client: Any) -> Any:
        await ask(client)  # the policy answers <answer>Vell</answer>: right, by the verifier
        return result

    eps = run_agent(agent)
    assert eps.rewards == [reward] and eps.stats.errors == eps.stats.no_reward == 0


def test_failure_lines_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    from rlf_train.rollout.agent_runner import _Reporter

    rep = _Reporter(every_s=0.2)
    for k in range(50):
        rep.report("timeout", "episode %d timed out", k)
    rep.report("error", "episode raised")  # another kind has its own budget
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["episode 0 timed out", "episode raised"]
    time.sleep(0.3)
    rep.report("timeout", "episode %d timed out", 50)
    assert caplog.records[-1].getMessage() == "episode 50 timed out (and 49 more since the last such line)"


def test_a_synchronous_client_inside_an_async_agent_still_gets_its_answers() -> None:
    """A synchronous framework called straight from `async def` (the sync `openai` client here) blocks the
    agents' loop while it waits, but the endpoint runs on rlf's loop, so its calls are answered (with the agents
    on the endpoint's loop this deadlocked until the client's own timeout)."""
    import openai

    async def sync_inside(task: Task, client: Any) -> None:
        c = openai.OpenAI(base_url=str(client.base_url), api_key=client.api_key, max_retries=0, timeout=10)
        c.chat.completions.create(model=client.model, messages=[{"role": "user", "content": task.question}])
        return None  # the last reply's <answer> is scored

    eps = run_agent(sync_inside)
    assert eps.rewards == [1.0] and eps.stats.errors == eps.stats.timeouts == 0 and eps.stats.calls == 1
