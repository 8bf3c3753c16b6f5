"""Harbor tasks on sessions: the session spec (local: Dockerfile replay in an image session with a writable root;
docker: the built image), the replay at session start, the verifier run (`tests/test.sh` from `/tests` on a fresh
session with the episode's workdir diff applied, the reward read from `/logs/verifier/`) and the oracle
(`solution/solve.sh` from `/solution`). See `rlf_envs.tasks.harbor` for the format and what the local backend replays.

What the verifier takes from the episode is its workdir diff, less what would run inside the verifier's own
machinery (`harbor_filter`): `conftest.py`, `pytest.ini`, pytest sections added to `pyproject.toml`/`setup.cfg`/
`tox.ini`, `sitecustomize.py`/`usercustomize.py`, `*.pth`, `__pycache__/`, new modules at the workdir's root named
like a module of the image (its own interpreter lists them on the pristine session), paths outside the workdir or
inside /tests, /logs, /solution. test.sh runs with PYTHONSAFEPATH=1 and PYTHONNOUSERSITE=1 (the task's verifier env
may override them); when it returns, every process it left is killed before the reward is read. The reward must be
a regular file, and of the kind test.sh writes (a test.sh that names only reward.txt is not scored from a
reward.json): anything else is tampering (reward 0, `failure/tampering`). No reward at all is the episode's
failure (`failure/no_reward`, with test.sh's exit and stderr in the error), not an infrastructure failure: the code
under test can crash test.sh; `python -m rlf_envs.envs.swe.baseline --task-file` reports such tasks.
"""

from __future__ import annotations

import contextlib
import functools
import posixpath
import re
import secrets
import shlex
from pathlib import Path
from typing import Any

from rlf_envs.envs.swe.verify import (
    KILL_LEFTOVERS,
    Verdict,
    creates_file,
    module_names,
    run_probe,
    shadowed_module,
    split_patch,
)
from rlf_envs.sandbox.sessions import SessionError, SessionInfraError, SessionLimits, SessionSpec
from rlf_envs.tasks.harbor import (
    REWARD_DIR,
    DockerPlan,
    HarborError,
    HarborTask,
    build_docker_image,
    docker_image_workdir,
    load_harbor_task,
    materialise_seed,
    parse_reward,
    plan_dockerfile,
)


@functools.lru_cache(maxsize=256)
def _task(path: str) -> HarborTask:
    return load_harbor_task(path)


def _plan(path: str, build_args: tuple[tuple[str, str], ...], base_images: tuple[tuple[str, str], ...],
          workdir: str | None) -> DockerPlan:
    return plan_dockerfile(Path(path) / "environment", Path(path) / "environment" / "Dockerfile",
                           build_args=dict(build_args), base_images=dict(base_images), workdir=workdir)


_plan_cached = functools.lru_cache(maxsize=256)(_plan)


@functools.lru_cache(maxsize=256)
def _image_workdir(image: str) -> str | None:
    return docker_image_workdir(image)


def harbor_spec(h: dict[str, Any], backend: str, limits: SessionLimits) -> tuple[SessionSpec, list[tuple[Any, ...]]]:
    """The session spec of a Harbor task and the steps to replay at each session start."""
    task = _task(h["path"])
    cfg = task.config
    ba = tuple(sorted((h.get("build_args") or {}).items()))
    lim = limits
    if cfg.memory_mb:
        lim = SessionLimits(memory_mb=max(cfg.memory_mb, 64), pids=limits.pids, disk_mb=limits.disk_mb,
                            exec_timeout_s=limits.exec_timeout_s, session_timeout_s=limits.session_timeout_s,
                            output_bytes=limits.output_bytes)
    if backend == "docker":
        image = build_docker_image(task, dict(ba))
        workdir = cfg.workdir or _image_workdir(image)  # the image's own WORKDIR (ARG/ENV expanded by the build)
        if workdir in (None, "/"):
            workdir = "/app"  # Harbor's convention
        return SessionSpec(image=image, workdir=workdir or "/app", env={"LANG": "C.UTF-8", **cfg.env},
                           network=False, limits=lim), []
    plan = _plan_cached(task.path, ba, tuple(sorted((h.get("base_images") or {}).items())), cfg.workdir)
    seed = materialise_seed(plan, task.path) if plan.seed else None
    env = {"LANG": "C.UTF-8", **plan.env, **cfg.env}
    return SessionSpec(image=plan.base, workdir=plan.workdir, seed_dir=seed, env=env, network=False,
                       limits=lim, writable_root=plan.base != "host"), plan.steps


async def prepare(session: Any, steps: list[tuple[Any, ...]], timeout_s: float = 600.0) -> None:
    """Replay the Dockerfile's steps that are not the seed (files outside the workdir, RUN) in `session`."""
    for st in steps:
        if st[0] == "file":
            mode = st[3] if len(st) > 3 and st[3] is not None else (Path(st[1]).stat().st_mode & 0o777)
            await session.write_file(st[2], Path(st[1]).read_bytes(), mode=mode)
        else:
            _, cmd, cwd, env = st
            r = await session.exec(cmd, cwd=cwd, env=dict(env), timeout_s=timeout_s)  # type: ignore[arg-type]
            if not r.ok:
                why = "timed out" if r.timed_out else f"exit {r.exit_code}"
                raise HarborError(f"Dockerfile RUN {cmd[:160]!r} failed in the session ({why}; sessions are "
                                  "offline and run steps as an unprivileged user: a step that downloads or "
                                  "rewrites the image's own files needs the docker backend): "
                                  f"{(r.stderr or r.stdout).strip()[-300:]}")


async def _dirs(session: Any) -> None:
    """Harbor's fixed paths: /tests (the verifier's files), /logs/verifier (its reward), /logs/agent."""
    r = await session.exec("mkdir -p /tests /logs/verifier /logs/agent /solution", timeout_s=30)
    if not r.ok:
        raise HarborError(f"could not create /tests and /logs in the session (a Harbor task needs a writable root: "
                          f"SessionSpec(writable_root=True)): {r.stderr.strip()[:300]}")


async def _upload(session: Any, src: Path, dest: str) -> None:
    for f in sorted(src.rglob("*")):
        if not f.is_file():
            continue
        mode = 0o755 if f.suffix == ".sh" or (f.stat().st_mode & 0o111) else 0o644
        await session.write_file(f"{dest}/{f.relative_to(src).as_posix()}", f.read_bytes(), mode=mode)


HOOK_NAMES = frozenset({"conftest.py", "pytest.ini", ".pytest.ini", "sitecustomize.py", "usercustomize.py",
                        "__pycache__"})
_PYTEST_SECTION = re.compile(r"^\+\s*\[(tool\.pytest|pytest|tool:pytest)", re.M)
VERIFIER_ENV = {"PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
HARBOR_DIRS = ("/tests", "/logs", "/solution")


def harbor_filter(patch: str, workdir: str = "/app", modules: frozenset[str] = frozenset()) -> tuple[str, int]:
    """A Harbor episode's patch for the verifier (see the module doc); returns (text, files dropped)."""
    kept, dropped = [], 0
    for old, new, text in split_patch(patch):
        bad = False
        for p in (old, new):
            parts = p.split("/")
            where = posixpath.normpath(posixpath.join(workdir, p))
            outside = p.startswith("/") or ".." in parts or parts[0] == ".git" or any(
                where == d or where.startswith(d + "/") for d in HARBOR_DIRS)
            if outside or any(part in HOOK_NAMES for part in parts) or p.endswith((".pth", ".pyc")):
                bad = True
        name = new.split("/")[-1]
        if not bad and name in ("pyproject.toml", "setup.cfg", "tox.ini") and _PYTEST_SECTION.search(text):
            bad = True
        if not bad and modules and creates_file(text) and shadowed_module(new, ("",), modules) is not None:
            bad = True
        if bad:
            dropped += 1
        else:
            kept.append(text)
    return "".join(kept), dropped


def expected_reward_files(test_sh: str) -> tuple[str, ...]:
    """Which reward files a test.sh writes, read from its text (both when it names neither or both)."""
    names = tuple(n for n in ("reward.txt", "reward.json") if n in test_sh)
    return names or ("reward.txt", "reward.json")


#: runs test.sh (the nonce on stdin, its output to a log), then counts the processes of the run still alive (not
#: this shell, its ancestors, pid 1 or zombies), kills them all and prints "<nonce> <exit> <alive>" as the last line
RUN_TEST_SH = r"""read -r nonce
cd "$1" && bash /tests/test.sh >/tmp/.rlf_verifier.log 2>&1 </dev/null
rc=$?
mine=" $$ 1 "
p=$$
while [ "$p" -gt 1 ] 2>/dev/null; do
  pp=0
  while read -r k v; do [ "$k" = "PPid:" ] && pp=$v && break; done < /proc/$p/status
  mine="$mine$pp "
  p=$pp
done
alive=0
for d in /proc/[0-9]*; do
  q=${d#/proc/}
  case "$mine" in *" $q "*) continue;; esac
  line=""
  read -r line < "$d/stat" 2>/dev/null || continue
  case "$line" in *") Z "*|*") X "*|"") continue;; esac
  alive=$((alive+1))
done
kill -9 -1 2>/dev/null
echo "$nonce $rc $alive"
"""

_REWARD_KINDS = ("for f in reward.txt reward.json; do if [ -L \"$f\" ]; then echo \"$f link\"; "
                 "elif [ -f \"$f\" ] && [ ! -w \"$f\" ]; then echo \"$f read-only file\"; "
                 "elif [ -f \"$f\" ]; then echo \"$f file\"; elif [ -e \"$f\" ]; then echo \"$f other\"; fi; done")


async def run_harbor_verifier(session: Any, h: dict[str, Any], patch: str,
                              steps: list[tuple[Any, ...]]) -> Verdict:
    """On a fresh session: replay, apply the episode's patch, upload tests/, run test.sh, read the reward."""
    task = _task(h["path"])
    v = Verdict(f2p_total=1)
    await prepare(session, steps, task.config.build_timeout_s)
    start = await session.diff()  # what the replayed RUN steps changed in the workdir: undone before the patch
    modules = module_names((await run_probe(session, "python3", "/"))[1])  # none without python3: no shadowing
    text, v.dropped_files = harbor_filter(patch, session.spec.workdir, modules)
    wd = shlex.quote(session.spec.workdir)
    for name, body, reverse in (("start.patch", start, True), ("agent.patch", text, False)):
        if not body.strip():
            continue
        await session.write_file(f"/tmp/.rlf_{name}", body)
        r = await session.exec(f"cd {wd} && git apply --whitespace=nowarn {'-R ' if reverse else ''}"
                               f"/tmp/.rlf_{name}", timeout_s=120)
        if not r.ok:
            if reverse:
                raise HarborError(f"the Dockerfile's RUN steps are not reproducible: {r.stderr.strip()[:300]}")
            v.apply_failed = True
            return v.fail("apply_failed", f"the patch does not apply: {r.stderr.strip()[:300]}")
    await _dirs(session)
    await _upload(session, Path(task.path) / "tests", "/tests")
    env = {**VERIFIER_ENV, **task.config.verifier_env}
    test_sh = (Path(task.path) / "tests" / "test.sh").read_text(encoding="utf-8", errors="replace")
    nonce = secrets.token_hex(16)
    try:  # from here on, the episode's code runs: what it causes is its own failure
        r = await session.exec(["sh", "-c", RUN_TEST_SH, "rlf-verifier", session.spec.workdir], stdin=nonce + "\n",
                               env=env, timeout_s=task.config.verifier_timeout_s)
        await session.exec(KILL_LEFTOVERS, timeout_s=30)
        kinds = dict(line.split(" ", 1) for line in (await session.exec(
            ["sh", "-c", _REWARD_KINDS], cwd=REWARD_DIR, timeout_s=30)).stdout.split("\n") if " " in line)
        got: dict[str, bytes | None] = {}
        for name in ("reward.txt", "reward.json"):
            got[name] = await session.read_file(f"{REWARD_DIR}/{name}") if kinds.get(name) == "file" else None
        log_tail = ""
        with contextlib.suppress(SessionError):
            log_tail = (await session.read_file("/tmp/.rlf_verifier.log"))[-2000:].decode("utf-8", "replace")
    except SessionInfraError:
        raise
    except SessionError as e:
        return v.fail("hidden_run_error", f"the verifier run failed: {str(e)[:300]}")
    last = r.stdout.strip().rsplit("\n", 1)[-1].split() if r.stdout.strip() else []
    if r.timed_out:
        return v.fail("timeout", f"test.sh ran past {task.config.verifier_timeout_s:.0f} s")
    if len(last) != 3 or last[0] != nonce or not last[1].isdigit() or not last[2].isdigit():
        return v.fail("no_report", f"the verifier run did not finish (exit {r.exit_code}): {log_tail[-300:]}")
    test_rc, alive = int(last[1]), int(last[2])
    if test_rc > 128:  # test.sh itself was killed (by the code under test, or its memory): what it wrote is not whole
        return v.fail("verifier_killed", f"test.sh was killed (exit {test_rc}) before it finished: "
                                         f"{log_tail.strip()[-300:]}")
    wanted = expected_reward_files(test_sh)
    odd = [f"{n} is a {k}" for n, k in kinds.items() if k != "file"] + \
          [f"{n} was written but test.sh writes only {' and '.join(wanted)}" for n in kinds if n not in wanted]
    if odd:
        v.tampering = True
        return v.fail("tampering", f"the reward files were tampered with: {'; '.join(odd)}")
    reward = parse_reward(got.get("reward.txt"), got.get("reward.json"))
    if reward is None or reward != reward:  # None or NaN
        return v.fail("no_reward", f"test.sh wrote no reward (/logs/verifier/reward.txt or reward.json); exit "
                                   f"{test_rc}: {log_tail.strip()[-300:]}")
    if alive and reward > 0:  # a process of the run outlived test.sh: it could have written the reward
        return v.fail("leftover_processes", f"{alive} process(es) of the verifier run were still running when "
                                            "test.sh ended; a reward they could have written is not taken")
    v.value = max(0.0, min(1.0, reward))
    v.f2p_passed = int(v.value >= 1.0)
    return v


async def run_solution(session: Any, h: dict[str, Any]) -> Any:
    """Harbor's oracle: upload solution/ and run solve.sh in the (agent's) session."""
    task = _task(h["path"])
    sol = Path(task.path) / "solution"
    if not (sol / "solve.sh").is_file():
        raise HarborError(f"{task.path}: no solution/solve.sh")
    await _dirs(session)
    await _upload(session, sol, "/solution")
    return await session.exec(f"cd {shlex.quote(session.spec.workdir)} && bash /solution/solve.sh",
                              env=task.config.solution_env or None, timeout_s=task.config.agent_timeout_s)


__all__ = ["expected_reward_files", "harbor_filter", "harbor_spec", "prepare", "run_harbor_verifier",
           "run_solution"]
