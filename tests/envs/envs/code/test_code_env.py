"""rlf/Code-v0: shipped tasks, per-episode work dirs, hostile code through the env, per-task rewards,
Gymnasium conformance in text and token mode, ToolVectorEnv, failure paths."""

from __future__ import annotations

import json
import os
import secrets
import textwrap
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
import tokenizers
from gymnasium.utils.env_checker import check_env
from tokenizer_support import train_bpe

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs import runtime
from rlf_envs.env import ToolVectorEnv
from rlf_envs.envs.code import DEFAULT_LIMITS, CodeEnv, code_tasks, python_tool
from rlf_envs.sandbox import SandboxLimits
from rlf_envs.types import Task, ToolStatus

FAST = SandboxLimits(timeout_s=3.0, cpu_s=3, memory_mb=256, max_output_bytes=4096, max_processes=16)


def call(code: str, **extra: Any) -> str:
    payload = json.dumps({"name": "python", "arguments": {"code": code, **extra}})
    return f"<tool_call>\n{payload}\n</tool_call><|im_end|>"


def answer(text: object) -> str:
    return f"<answer>{text}</answer><|im_end|>"


def response(obs: str) -> str:
    return obs.split("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]


def one_per_family(split: str = "test") -> list[int]:
    seen: dict[str, int] = {}
    for i, t in enumerate(code_tasks(split)):
        seen.setdefault(str(t.meta["family"]), i)
    return list(seen.values())


def test_shipped_splits_are_disjoint_and_well_formed() -> None:
    train, test = code_tasks("train"), code_tasks("test")
    assert 250 <= len(train) + len(test) <= 600 and len(test) >= 50
    assert not {t.question for t in train} & {t.question for t in test}
    assert len({t.question for t in train}) == len(train)
    checks = {t.meta["check"] for t in train}
    assert checks == {"numeric", "exact", "tests"}
    assert any(t.meta.get("files") for t in test)
    assert len({t.meta["family"] for t in test}) >= 10


def test_generator_is_deterministic_and_matches_shipped_files(tmp_path: Path) -> None:
    from rlf_envs.data.code import DATA_DIR
    from rlf_envs.data.code.generate import write

    write(tmp_path)
    for rel in ("train.jsonl", "test.jsonl", "sft_demos.jsonl"):
        assert (tmp_path / rel).read_bytes() == (DATA_DIR / rel).read_bytes(), rel


def test_reference_programs_earn_the_reward_through_the_env() -> None:
    """One task per family: the reference program's output, answered, scores 1 (numeric, exact and hidden
    tests); a wrong answer scores 0. Proves the shipped answers need (and match) the computation."""
    env = CodeEnv(split="test", limits=FAST)
    for i in one_per_family():
        task = env.tasks[i]
        env.reset(seed=0, options={"task_index": i})
        obs, r, term, trunc, _ = env.step(call(str(task.meta["program"])))
        out = response(obs)
        assert out.startswith("[stdout]\n") and not term, (task.meta["family"], out)
        printed = out.removeprefix("[stdout]\n")
        final = task.meta["program"] if task.meta["check"] == "tests" else printed
        _, r, term, _, info = env.step(answer(final))
        assert term and r == 1.0, (task.meta["family"], printed, task.ground_truth, info["score"])
        assert info["score"].info[f"check/{task.meta['check']}"] == 1.0
        env.reset(seed=0, options={"task_index": i})
        wrong = "def count_multiples(n):\n    return 0" if task.meta["check"] == "tests" else "plums-1"
        _, r, term, _, _ = env.step(answer(wrong))
        assert term and r == 0.0, task.meta["family"]
    env.close()


def test_work_dir_is_per_episode_and_removed_at_every_end() -> None:
    tasks = [Task("data", "Sum the file.", "6", meta={"check": "numeric", "files": {"nums.txt": "1\n2\n3\n"}}),
             Task("plain", "Print 1.", "1", meta={"check": "numeric"})]
    env = CodeEnv(tasks=tasks, limits=FAST, max_turns=3)
    env.reset(seed=0, options={"task_index": 0})
    assert env.workdir is None  # nothing is created before the first call
    obs, *_ = env.step(call("print(sum(map(int, open('nums.txt'))))\nopen('keep.txt', 'w').write('x')"))
    assert response(obs) == "[stdout]\n6"
    first = env.workdir
    assert first is not None and (first.path / "keep.txt").exists()
    obs, *_ = env.step(call("import os\nprint(sorted(os.listdir('.')))"))
    assert "keep.txt" in response(obs) and env.workdir is first  # files persist within the episode
    _, r, term, _, _ = env.step(answer(6))
    assert term and r == 1.0 and env.workdir is None and not first.root.exists()  # gone once scored
    # a new episode starts empty; reset before the episode finished removes its dir
    env.reset(seed=0, options={"task_index": 1})
    obs, *_ = env.step(call("import os\nprint(sorted(os.listdir('.')))"))
    assert response(obs) == "[stdout]\n['.rlf_main.py']"
    second = env.workdir
    assert second is not None
    env.reset(seed=0, options={"task_index": 1})
    assert not second.root.exists()
    # truncation (max turns) removes it too
    for _ in range(3):
        _, _, term, trunc, _ = env.step(call("print(1)"))
    assert trunc and env.workdir is None
    # and close()
    env.reset(seed=0, options={"task_index": 1})
    env.step(call("print(1)"))
    fourth = env.workdir
    assert fourth is not None
    env.close()
    assert not fourth.root.exists()


def test_an_env_dropped_without_close_leaves_no_dir() -> None:
    import gc

    env = CodeEnv(split="test", limits=FAST)
    env.reset(seed=0, options={"task_index": 0})
    env.step(call("print(1)"))
    assert env.workdir is not None
    root = env.workdir.root
    del env
    gc.collect()
    assert not root.exists()


FORGED = "__workdir__"  # the argument name the binding once had: a policy may still send it


def test_the_policy_cannot_choose_its_work_dir(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    env = CodeEnv(split="test", limits=FAST)
    env.reset(seed=0, options={"task_index": 0})
    obs, *_ = env.step(call("import os\nprint(os.getcwd())", **{FORGED: str(victim)}))
    [res] = env.trajectory.turns[-1].results
    assert res.status is ToolStatus.INVALID_ARGS and f"unknown argument(s) {FORGED}" in res.content
    assert res.call.arguments[FORGED] == str(victim) and res.call.context is None  # recorded as sent, unbound
    obs, *_ = env.step(call("import os\nprint(os.getcwd())"))  # the episode's own dir, not the victim
    assert str(victim) not in response(obs) and response(obs).startswith("[stdout]\n/")
    env.close()
    # outside rlf/Code-v0 a forged work dir is an argument error, not a path
    tools_env = gym.make("rlf/Tools-v0", tools=[python_tool(FAST)], tasks=[Task("t", "q", "1")]).unwrapped
    tools_env.reset(seed=0)
    tools_env.step(call("print(1)", **{FORGED: str(victim)}))
    [res] = tools_env.trajectory.turns[-1].results
    assert res.status is ToolStatus.INVALID_ARGS and "unknown argument" in res.content


def test_hostile_code_is_contained(leftovers: Callable[[str], list[int]], isolated: None, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"rlf-secret-{secrets.token_hex(8)}"
    monkeypatch.setenv("RLF_TEST_SECRET", secret)
    marker = f"{3600 + secrets.randbelow(10**6) / 10**7:.7f}"
    # /tmp paths land in the run's private tmpfs (discarded); the cwd is ours, not the run uid's
    outside = [tmp_path / "escaped.txt", Path(f"/tmp/rlf_escape_{secrets.token_hex(6)}"),
               Path.cwd() / f"rlf_escape_{secrets.token_hex(6)}"]
    env = CodeEnv(tasks=[Task("t", "q", "1")], limits=FAST, max_turns=8)
    env.reset(seed=0)
    try:
        t0 = time.monotonic()
        obs, *_ = env.step(call("while True:\n    pass"))
        assert "[killed: time limit of 3 s]" in response(obs)
        assert time.monotonic() - t0 < 30.0  # the deadline fired (generous bound on a loaded box)
        obs, *_ = env.step(call("while True:\n    print('y' * 10000)"))
        assert "[killed: output over 4096 bytes]" in response(obs) and len(obs) < 3000
        writes = "\n".join(f"try:\n    open({str(p)!r}, 'w').write('x')\nexcept OSError:\n    pass" for p in outside)
        obs, *_ = env.step(call(writes + "\nprint('done')"))
        assert response(obs) == "[stdout]\ndone"
        snoop = textwrap.dedent(f"""
            import os, signal
            found = {secret!r} in repr(os.environ)
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        found |= {secret!r}.encode() in open(f"/proc/{{pid}}/environ", "rb").read()
                    except OSError:
                        pass
            if os.fork() == 0:
                os.setsid()
                os.execv("/bin/sleep", ["sleep", "{marker}"])
            for target in (os.getppid(), {os.getpid()}):
                if target > 1:
                    for send in (os.kill, os.killpg):
                        try:
                            send(target, signal.SIGKILL)
                            print("SIGNALLED", target)
                        except OSError:
                            pass
            print("SECRET" if found else "no secret")
        """)
        obs, *_ = env.step(call(snoop))
        assert response(obs) == "[stdout]\nno secret", response(obs)  # the supervisor survived to report
        assert leftovers(marker) == []  # the escaped grandchild died with the call
        obs, *_ = env.step(call("print('next call works')"))
        assert response(obs) == "[stdout]\nnext call works"
        _, r, term, _, _ = env.step(answer(1))
        assert term and r == 1.0  # and the scoring process is fine
    finally:
        env.close()
        for p in outside:
            exists = p.exists()
            p.unlink(missing_ok=True)
            assert not exists, p


def test_fork_bomb_is_bounded_by_the_process_limit(isolated: None) -> None:
    from rlf_envs.sandbox import run_python

    guards = runtime.run(run_python("pass", "", FAST)).guards
    if "nproc" not in guards or ("uid" not in guards and "user_ns" not in guards):
        pytest.skip(f"no enforced process limit here: {guards.get('nproc', 'none')}")
    bomb = textwrap.dedent("""
        import os, time
        n = 0
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            try:
                if os.fork() == 0:
                    time.sleep(60)
                    os._exit(0)
                n += 1
            except OSError:
                time.sleep(0.01)
        print("forked", n)
    """)
    env = CodeEnv(tasks=[Task("t", "q", "1")], limits=FAST)
    env.reset(seed=0)
    t0 = time.monotonic()
    obs, *_ = env.step(call(bomb))
    assert time.monotonic() - t0 < 30.0
    out = response(obs)
    assert out.startswith("[stdout]\nforked"), out
    assert int(out.split()[-1]) <= FAST.max_processes
    obs, *_ = env.step(call("print('alive')"))
    assert response(obs) == "[stdout]\nalive"
    env.close()


def test_task_and_argument_errors() -> None:
    bad = [
        (Task("a", "q", "1", meta={"check": "regex"}), "meta['check'] must be one of"),
        (Task("b", "q", "1", meta={"files": {"../x.csv": "1"}}), "plain file name"),
        (Task("c", "q", "1", meta={"files": {".rlf_main.py": "1"}}), "plain file name"),
        (Task("d", "q", "1", meta={"files": ["x.csv"]}), "map file names to text"),
    ]
    for task, message in bad:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
            CodeEnv(tasks=[task])
    with pytest.raises(ValueError, match="max_output_chars"):
        CodeEnv(split="test", max_output_chars=10)
    with pytest.raises(ValueError, match="split must be"):
        CodeEnv(split="dev")
    with pytest.raises(Exception, match="timeout_s"):
        CodeEnv(split="test", limits={"timeout_s": -1})
    env = CodeEnv(split="test", limits=FAST, max_turns=6, max_total_tokens=32_000)
    env.reset(seed=0, options={"task_index": 0})
    for action, status, message in [
        (call("x" * 30_000), ToolStatus.INVALID_ARGS, "the limit is 20000"),
        (call("print(1)", stdin=3), ToolStatus.INVALID_ARGS, "must be strings"),
        (call("print(1)", cwd="/"), ToolStatus.INVALID_ARGS, "unknown argument"),
        (call("import sys\nsys.exit(5)"), ToolStatus.OK, "[exit status 5]"),
        (call("x = [0] * (10 ** 9)"), ToolStatus.OK, "MemoryError"),
    ]:
        env.step(action)
        [res] = env.trajectory.turns[-1].results
        assert res.status is status and message in res.content, (action[:80], res.content)
    env.close()


def test_unparsable_or_missing_answers_score_zero() -> None:
    env = CodeEnv(split="test", limits=FAST, max_turns=1)
    i = one_per_family()[0]
    env.reset(seed=0, options={"task_index": i})
    _, r, term, _, info = env.step(answer("no idea"))
    assert term and r == 0.0
    env.reset(seed=0, options={"task_index": i})
    _, r, term, trunc, info = env.step(call("print(1)"))
    assert trunc and r == 0.0 and env.workdir is None


def make_tokenizer() -> tokenizers.Tokenizer:
    """A byte-level BPE trained here, offline, on the env's prompts and its reference programs."""
    env = CodeEnv(split="test")
    text = [env.format.render_prompt(t, env.toolbox.specs, env.system_prompt) for t in env.tasks[:20]]
    return train_bpe(text + [str(t.meta["program"]) for t in env.tasks], 400)


def test_check_env_text_and_token_mode() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(gym.make("rlf/Code-v0", split="test", limits=FAST).unwrapped, skip_render_check=True)
        check_env(gym.make("rlf/Code-v0", split="test", limits=FAST, tokenizer=make_tokenizer()).unwrapped,
                  skip_render_check=True)


def test_token_mode_episode_keeps_exact_ids() -> None:
    tok = make_tokenizer()
    env = CodeEnv(split="test", limits=FAST, tokenizer=tok)
    i = one_per_family()[0]
    task = env.tasks[i]
    obs, _ = env.reset(seed=0, options={"task_index": i})
    a1 = tok.encode(call(str(task.meta["program"]))).ids
    obs1, *_ = env.step(a1)
    final = task.meta["program"] if task.meta["check"] == "tests" else task.ground_truth
    a2 = tok.encode(answer(final)).ids
    _, r, term, _, _ = env.step(a2)
    traj = env.trajectory
    assert term and r == 1.0
    assert traj.token_ids == [*obs.tolist(), *a1, *obs1.tolist(), *a2]
    assert traj.loss_mask == [0] * len(obs) + [1] * len(a1) + [0] * len(obs1) + [1] * len(a2)
    env.close()


def test_vector_env_keeps_episodes_apart() -> None:
    """Envs of one batch share the tool but not their work dirs: a file one episode writes, the others
    never see; every dir is gone when its episode ends."""
    venv = gym.make_vec("rlf/Code-v0", num_envs=3, split="test", limits=FAST)
    assert isinstance(venv, ToolVectorEnv)
    envs = [e for e in venv.envs]
    assert len({id(e.toolbox) for e in envs}) == 1

    async def episode() -> dict[int, Any]:
        await venv.areset_envs({k: {"task_index": k} for k in range(3)})
        await venv.astep_active({k: call(f"open('mine.txt', 'w').write('{k}')") for k in range(3)})
        read = await venv.astep_active({k: call("print(open('mine.txt').read())") for k in range(3)})
        dirs = [e.workdir for e in envs]
        done = await venv.astep_active({k: answer("0") for k in range(3)})
        return {k: (response(read[k].obs), dirs[k], done[k].terminated) for k in range(3)}

    out = runtime.run(episode())
    for k in range(3):
        text, d, term = out[k]
        assert text == f"[stdout]\n{k}" and term and d is not None and not d.root.exists()
    assert len({out[k][1].root for k in range(3)}) == 3  # type: ignore[union-attr]
    venv.close()


def test_default_limits_are_enforced_not_just_declared() -> None:
    assert DEFAULT_LIMITS.max_processes <= 64 and not DEFAULT_LIMITS.network
    env = CodeEnv(split="test")
    assert env.toolbox.tools["python"].limits == DEFAULT_LIMITS  # type: ignore[attr-defined]
    assert f"{DEFAULT_LIMITS.memory_mb} MB" in env.toolbox.specs[0].description
    env.reset(seed=0, options={"task_index": 0})
    obs, *_ = env.step(call("import os\nprint(sorted(os.environ))"))
    names = json.loads(response(obs).removeprefix("[stdout]\n").replace("'", '"'))
    assert set(names) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
                          "PYTHONIOENCODING", "PWD", "USER", "LOGNAME", "SHLVL", "_", "LC_CTYPE"}, names
    assert not any(k in names for k in os.environ if k.startswith(("RLF_", "HF_", "OPENAI", "AWS")))
    env.close()
