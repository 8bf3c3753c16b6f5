"""Harbor tasks on sessions: the session spec (local: Dockerfile replay in an image session with a writable root;
docker: the built image), the replay at session start, the verifier run (`tests/test.sh` from `/tests` on a fresh
session with the episode's workdir diff applied, the reward read from `/logs/verifier/`) and the oracle
(`solution/solve.sh` from `/solution`). See `rlf_envs.tasks.harbor` for the format and what the local backend replays.
"""

from __future__ import annotations

import functools
import shlex
from pathlib import Path
from typing import Any

from rlf_envs.envs.swe.verify import Verdict, split_patch
from rlf_envs.sandbox.sessions import SessionLimits, SessionSpec
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


def lenient_filter(patch: str) -> tuple[str, int]:
    """A Harbor episode's patch: every file diff but `.git/` and paths outside the workdir."""
    kept, dropped = [], 0
    for old, new, text in split_patch(patch):
        bad = any(p.startswith("/") or ".." in p.split("/") or p.split("/")[0] == ".git" for p in (old, new))
        if bad:
            dropped += 1
        else:
            kept.append(text)
    return "".join(kept), dropped


async def run_harbor_verifier(session: Any, h: dict[str, Any], patch: str,
                              steps: list[tuple[Any, ...]]) -> Verdict:
    """On a fresh session: replay, apply the episode's patch, upload tests/, run test.sh, read the reward."""
    task = _task(h["path"])
    v = Verdict(f2p_total=1)
    await prepare(session, steps, task.config.build_timeout_s)
    start = await session.diff()  # what the replayed RUN steps changed in the workdir: undone before the patch
    text, v.dropped_files = lenient_filter(patch)
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
            v.apply_failed, v.error = True, f"the patch does not apply: {r.stderr.strip()[:300]}"
            return v
    await _dirs(session)
    await _upload(session, Path(task.path) / "tests", "/tests")
    env = {**task.config.verifier_env}
    r = await session.exec(f"cd {wd} && bash /tests/test.sh", env=env or None,
                           timeout_s=task.config.verifier_timeout_s)
    rdir = REWARD_DIR
    got: list[bytes | None] = []
    for name in ("reward.txt", "reward.json"):
        try:
            got.append(await session.read_file(f"{rdir}/{name}"))
        except Exception:
            got.append(None)
    reward = parse_reward(got[0], got[1])
    if reward is None:
        v.error = ("test.sh wrote no reward (/logs/verifier/reward.txt or reward.json)"
                   + (" and timed out" if r.timed_out else f"; exit {r.exit_code}: {r.stderr.strip()[-300:]}"))
        return v
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


__all__ = ["harbor_spec", "lenient_filter", "prepare", "run_harbor_verifier", "run_solution"]
