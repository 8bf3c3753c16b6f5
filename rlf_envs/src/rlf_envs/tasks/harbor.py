"""Harbor tasks, loaded unchanged: `instruction.md`, `task.toml`, `environment/Dockerfile`, `tests/test.sh`,
optional `solution/solve.sh` (Harbor, the Terminal-Bench successor; https://harborframework.com/docs/tasks).

`task.toml`: both spellings in use are read: `version = "1.0"` (flat `[metadata]`) and `schema_version = "1.1"`
and later (`[task]` name/description, `[metadata]`); `[verifier] timeout_sec, env`, `[agent] timeout_sec`,
`[solution] env`, `[environment] build_timeout_sec, docker_image, cpus, memory_mb | memory ("4G"), storage_mb
| storage, allow_internet | network_mode, env, workdir`. Unknown keys are ignored, as Harbor ignores them.

How a task runs here: the agent works in a session whose workdir is the Dockerfile's final `WORKDIR` (or
`[environment] workdir`). When the episode ends, its workdir diff is applied to a FRESH session of the same
environment, `tests/` is uploaded to `/tests`, `bash /tests/test.sh` runs there (the `[verifier]` deadline and
env), and the reward is `/logs/verifier/reward.txt` (a number) or `reward.json` (its `reward` key, else the mean
of its numbers). So the tests are never visible to the agent and nothing it left running reaches the verdict;
changes outside the workdir are not carried over (Harbor itself grades the agent's container: tasks whose
result lives outside `WORKDIR` need a `WORKDIR` that covers it).

Environments:
- docker backend: the image is built from `environment/` (`build_docker_image`, the docker SDK) or
  `[environment] docker_image` is used as is.
- local backend: the Dockerfile is replayed (`DockerPlan`): `FROM` names a root filesystem (a directory,
  `oci-archive:PATH`, `rootfs-tar:PATH`, "host", or an image reference mapped by `base_images=`), `ARG` (with
  `build_args=` overriding defaults, e.g. `ARG BASE` + `FROM ${BASE}`), `ENV`, `WORKDIR`, `COPY` (from the build
  context; files under the final WORKDIR become the session's seed, others are written at session start) and
  `RUN` (run in the session at its start). `LABEL`, `EXPOSE`, `CMD`, `ENTRYPOINT`, `STOPSIGNAL`, `HEALTHCHECK`
  and `MAINTAINER` change no file and are ignored; any other instruction (`USER`, `ADD`, `VOLUME`, `SHELL`,
  `ONBUILD`, `COPY --from`, multi-stage builds...) is refused by name.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from rlf_envs.errors import RlfError
from rlf_envs.types import Task

IGNORED = frozenset({"LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "STOPSIGNAL", "HEALTHCHECK", "MAINTAINER", "VOLUME"})
REPLAYED = frozenset({"FROM", "ARG", "ENV", "WORKDIR", "COPY", "ADD", "RUN", "USER"})
ARCHIVES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")
REWARD_DIR = "/logs/verifier"


class HarborError(RlfError, ValueError):
    """A Harbor task that cannot be loaded or replayed (says what and how to fix it)."""


def _size_mb(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(value), re.I)
    if not m:
        raise HarborError(f"{where}: {value!r} is not a size like '4G' or '512M'")
    scale = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


@dataclass(frozen=True)
class HarborConfig:
    """The parts of task.toml rlf uses (Harbor's names; deprecated spellings normalised)."""

    name: str
    schema: str
    verifier_timeout_s: float = 600.0
    verifier_env: dict[str, str] = field(default_factory=dict)
    agent_timeout_s: float = 600.0
    solution_env: dict[str, str] = field(default_factory=dict)
    build_timeout_s: float = 600.0
    docker_image: str | None = None
    cpus: int | None = None
    memory_mb: int | None = None
    storage_mb: int | None = None
    network: bool = True
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


def _table(data: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    v = data.get(key, {})
    if not isinstance(v, dict):
        raise HarborError(f"{where}: [{key}] must be a table")
    return v


def _env(v: Any, where: str) -> dict[str, str]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise HarborError(f"{where}: env must be a table of strings")
    return {str(k): str(x) for k, x in v.items()}


def parse_task_toml(text: str, where: str, default_name: str) -> HarborConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise HarborError(f"{where}: not TOML ({e})") from None
    schema = data.get("schema_version", data.get("version"))
    if schema is None:
        raise HarborError(f"{where}: needs `version = \"1.0\"` or `schema_version = \"1.1\"` (Harbor's task.toml)")
    schema = str(schema)
    if not re.fullmatch(r"1(\.\d+)*", schema):
        raise HarborError(f"{where}: schema version {schema!r} is not one this loader knows (1.x)")
    task = _table(data, "task", where)
    ver, agent, env = _table(data, "verifier", where), _table(data, "agent", where), _table(data, "environment", where)
    sol = _table(data, "solution", where)
    network = env.get("allow_internet", True)
    if "network_mode" in env:
        network = env["network_mode"] != "no-network"
    try:
        return HarborConfig(
            name=str(task.get("name") or default_name), schema=schema,
            verifier_timeout_s=float(ver.get("timeout_sec", 600.0)), verifier_env=_env(ver.get("env"), where),
            agent_timeout_s=float(agent.get("timeout_sec", 600.0)), solution_env=_env(sol.get("env"), where),
            build_timeout_s=float(env.get("build_timeout_sec", 600.0)),
            docker_image=str(env["docker_image"]) if env.get("docker_image") else None,
            cpus=int(env["cpus"]) if env.get("cpus") is not None else None,
            memory_mb=_size_mb(env.get("memory_mb", env.get("memory")), f"{where} [environment] memory"),
            storage_mb=_size_mb(env.get("storage_mb", env.get("storage")), f"{where} [environment] storage"),
            network=bool(network), env=_env(env.get("env"), where),
            workdir=str(env["workdir"]) if env.get("workdir") else None,
            metadata=dict(_table(data, "metadata", where)),
        )
    except (TypeError, ValueError) as e:
        if isinstance(e, HarborError):
            raise
        raise HarborError(f"{where}: {e}") from None


# -- Dockerfile ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int


def parse_dockerfile(text: str, where: str) -> list[Instruction]:
    """Instructions of a Dockerfile: comments and blank lines dropped, `\\` continuations joined, heredocs refused."""
    out: list[Instruction] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        kw, _, args = buf.strip().partition(" ")
        if "<<" in args and re.search(r"<<-?\s*['\"]?[A-Za-z_]+", args) and kw.upper() in ("RUN", "COPY"):
            raise HarborError(f"{where}:{start}: heredocs in {kw.upper()} are not supported by the local backend; "
                              "use the docker backend or a script file COPY'd in")
        out.append(Instruction(kw.upper(), args.strip(), start))
        buf = ""
    if buf:
        kw, _, args = buf.strip().partition(" ")
        out.append(Instruction(kw.upper(), args.strip(), start))
    return out


_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def substitute(text: str, values: Mapping[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        if name in values:
            return values[name]
        return m.group(2) if m.group(2) is not None else ""

    return _VAR.sub(one, text)


def _words(args: str, where: str) -> list[str]:
    if args.startswith("["):
        try:
            v = json.loads(args)
        except ValueError:
            raise HarborError(f"{where}: bad JSON array {args[:80]!r}") from None
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise HarborError(f"{where}: the JSON form must be an array of strings")
        return v
    return shlex.split(args)


def _pairs(args: str, where: str) -> list[tuple[str, str]]:
    """ENV/ARG's `k=v k2="v 2"` or the old `ENV k v` form."""
    words = shlex.split(args)
    if not words:
        raise HarborError(f"{where}: empty")
    if "=" not in words[0]:
        return [(words[0], args.split(None, 1)[1] if len(words) > 1 else "")]
    out = []
    for w in words:
        k, eq, v = w.partition("=")
        if not eq or not k:
            raise HarborError(f"{where}: {w!r} is not KEY=VALUE")
        out.append((k, v))
    return out


@dataclass
class DockerPlan:
    """What the local backend does for a Dockerfile: the base root, the env, the workdir, the files copied under
    the workdir (the seed: host path -> path relative to the workdir), and the steps replayed at session start
    (("file", host path, absolute dest) and ("run", command, cwd, env))."""

    base: str
    workdir: str
    env: dict[str, str]
    seed: dict[str, str] = field(default_factory=dict)
    steps: list[tuple[Any, ...]] = field(default_factory=list)
    seed_modes: dict[str, int] = field(default_factory=dict)  # `COPY --chmod` of seed files (by relative path)


def plan_dockerfile(context: Path, dockerfile: Path, *, build_args: Mapping[str, str] | None = None,
                    base_images: Mapping[str, str] | None = None, workdir: str | None = None) -> DockerPlan:
    """Replay plan of `dockerfile` with build context `context` (HarborError naming the line for what the local
    backend cannot do)."""
    name = str(dockerfile)
    instrs = parse_dockerfile(dockerfile.read_text(encoding="utf-8"), name)
    build_args = dict(build_args or {})
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    base: str | None = None
    cwd = "/"
    copies: list[tuple[Path, str]] = []
    steps: list[tuple[Any, ...]] = []
    for ins in instrs:
        where = f"{name}:{ins.line}: {ins.keyword}"
        values = {**args, **env}
        if ins.keyword in IGNORED:
            continue
        if ins.keyword not in REPLAYED:
            raise HarborError(f"{where}: the local backend cannot replay {ins.keyword} (it replays FROM, ARG, ENV, "
                              "WORKDIR, COPY and RUN); run this task on the docker backend")
        if ins.keyword == "ARG":
            for k, v in _pairs(ins.args, where) if "=" in ins.args else [(ins.args.strip(), "")]:
                args[k] = build_args.get(k, v)
        elif ins.keyword == "FROM":
            if base is not None:
                raise HarborError(f"{where}: multi-stage builds (a second FROM) are not replayed by the local backend")
            words = substitute(ins.args, {**build_args, **args}).split()
            if any(w.startswith("--") for w in words) or len(words) not in (1, 3):
                raise HarborError(f"{where}: only `FROM <image>` (optionally `AS name`) is replayed")
            base = resolve_base(words[0], base_images or {}, where)
        elif base is None:
            raise HarborError(f"{where}: comes before FROM")
        elif ins.keyword == "ENV":
            for k, v in _pairs(ins.args, where):
                env[k] = substitute(v, values)
        elif ins.keyword == "WORKDIR":
            p = substitute(ins.args.strip(), values)
            cwd = str(PurePosixPath(cwd) / p) if not p.startswith("/") else p
            steps.append(("run", f"mkdir -p {shlex.quote(cwd)}", "/", dict(env)))
        elif ins.keyword == "USER":
            if substitute(ins.args.strip(), values) not in ("root", "0", "root:root", "0:0"):
                raise HarborError(f"{where}: the local backend runs every step as the session's user: only "
                                  "`USER root` is replayed (as a no-op); run this task on the docker backend")
        elif ins.keyword in ("COPY", "ADD"):
            words = [substitute(w, values) for w in _words(ins.args, where)]
            if ins.keyword == "ADD":  # a local file or directory: as COPY; URLs and archives (auto-extracted) not
                srcs = [w for w in words if not w.startswith("--")][:-1]
                if any("://" in w or w.startswith("git@") for w in srcs):
                    raise HarborError(f"{where}: ADD of a URL downloads; the local backend is offline (use the "
                                      "docker backend, or put the file in the build context)")
                if any(w.lower().endswith(ARCHIVES) for w in srcs):
                    raise HarborError(f"{where}: ADD of an archive (auto-extracted) is not replayed by the local "
                                      "backend; COPY it and RUN tar, or use the docker backend")
            opts = [w for w in words if w.startswith("--")]
            if any(o.startswith("--from") for o in opts):
                raise HarborError(f"{where}: COPY --from (multi-stage) is not replayed by the local backend")
            bad = [o for o in opts if not o.startswith(("--chown", "--chmod", "--link"))]
            if bad:
                raise HarborError(f"{where}: {ins.keyword} option {bad[0]} is not supported by the local backend")
            chmod = [o.split("=", 1)[1] for o in opts if o.startswith("--chmod=")]
            try:
                mode = int(chmod[-1], 8) & 0o7777 if chmod else None
            except ValueError:
                raise HarborError(f"{where}: COPY --chmod takes an octal mode (e.g. --chmod=755)") from None
            paths = [w for w in words if not w.startswith("--")]
            if len(paths) < 2:
                raise HarborError(f"{where}: COPY needs a source and a destination")
            dest = paths[-1] if paths[-1].startswith("/") else str(PurePosixPath(cwd) / paths[-1])
            as_dir = paths[-1].endswith("/") or len(paths) > 2
            for src in paths[:-1]:
                matches = sorted(glob.glob(str(context / src)))
                if not matches:
                    raise HarborError(f"{where}: no file {src!r} in the build context {context}")
                for m in matches:
                    mp = Path(m).resolve()
                    if not mp.is_relative_to(context.resolve()):
                        raise HarborError(f"{where}: {src!r} is outside the build context")
                    if mp.is_dir():
                        for f in sorted(mp.rglob("*")):
                            if f.is_file():
                                copies.append((f, str(PurePosixPath(dest) / f.relative_to(mp).as_posix())))
                    else:
                        target = str(PurePosixPath(dest) / mp.name) if as_dir or mp.is_dir() else dest
                        copies.append((mp, target))
                        if not as_dir and len(matches) > 1:
                            raise HarborError(f"{where}: several sources need a destination ending in '/'")
            for host, target in copies:
                steps.append(("file", str(host), target, mode))  # mode None: the source file's (as docker does)
            copies.clear()
        elif ins.keyword == "RUN":
            cmd = ins.args
            if cmd.startswith("["):
                cmd = shlex.join(_words(cmd, where))
            if cmd.startswith("--"):
                raise HarborError(f"{where}: RUN options (--mount, --network...) are not replayed by the local backend")
            steps.append(("run", cmd, cwd, {**{k: v for k, v in args.items()}, **env}))
    if base is None:
        raise HarborError(f"{name}: no FROM")
    final = workdir or (cwd if cwd != "/" else None)
    if final is None:
        raise HarborError(f"{name}: no WORKDIR: the agent's workspace must be a directory other than '/' "
                          "(add WORKDIR /app, or [environment] workdir in task.toml)")
    plan = DockerPlan(base=base, workdir=final, env=env)
    wd = PurePosixPath(final)
    for st in steps:
        if st[0] == "file" and PurePosixPath(st[2]).is_relative_to(wd):
            rel = str(PurePosixPath(st[2]).relative_to(wd))
            plan.seed[st[1]] = rel
            if st[3] is not None:
                plan.seed_modes[rel] = st[3]
        elif st[0] == "run" and st[1] == f"mkdir -p {shlex.quote(final)}":
            continue
        else:
            plan.steps.append(st)
    return plan


def resolve_base(ref: str, base_images: Mapping[str, str], where: str) -> str:
    """The local backend's root for `FROM ref`."""
    if ref in base_images:
        return base_images[ref]
    if ref == "host" or ref.startswith(("oci-archive:", "rootfs-tar:")):
        return ref
    if ref.startswith("/") and os.path.isdir(ref):
        return ref
    raise HarborError(f"{where}: the local backend has no root filesystem for image {ref!r}: pass "
                      f"base_images={{{ref!r}: '/path/to/root' or 'oci-archive:/path/img.tar'}} (e.g. `docker save`), "
                      "or a build ARG naming a root directory, or use the docker backend")


def materialise_seed(plan: DockerPlan, key: str) -> str:
    """The seed directory (files COPY'd under the workdir) in rlf's cache, built once per plan."""
    from rlf_envs.envs.swe.tasks import cache_dir

    digest = hashlib.sha256(key.encode() + json.dumps([sorted(plan.seed.items()), sorted(plan.seed_modes.items())]
                                                      ).encode()
                            + b"".join(Path(h).read_bytes() for h in sorted(plan.seed))).hexdigest()[:16]
    out = cache_dir() / "harbor" / f"seed-{digest}"
    # the seeds' folder is 0700 (made so, or tightened): no session uid can read or traverse what rlf caches there
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if out.parent.lstat().st_uid == os.geteuid() and out.parent.stat().st_mode & 0o777 != 0o700:
        os.chmod(out.parent, 0o700)
    if not out.is_dir():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for host, rel in plan.seed.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(host, tmp / rel)
            if rel in plan.seed_modes:
                os.chmod(tmp / rel, plan.seed_modes[rel])
        try:
            os.replace(tmp, out)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


# -- tasks ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HarborTask:
    """A loaded Harbor task directory."""

    path: str
    instruction: str
    config: HarborConfig
    has_solution: bool


def load_harbor_task(path: str | os.PathLike[str]) -> HarborTask:
    d = Path(path)
    where = str(d)
    for req in ("instruction.md", "task.toml", "tests/test.sh"):
        if not (d / req).is_file():
            raise HarborError(f"{where}: not a Harbor task (no {req})")
    if not (d / "environment" / "Dockerfile").is_file():
        cfg_text = (d / "task.toml").read_text(encoding="utf-8")
        if "docker_image" not in cfg_text:
            raise HarborError(f"{where}: no environment/Dockerfile and no [environment] docker_image")
    cfg = parse_task_toml((d / "task.toml").read_text(encoding="utf-8"), f"{where}/task.toml", d.name)
    instruction = (d / "instruction.md").read_text(encoding="utf-8")
    if not instruction.strip():
        raise HarborError(f"{where}/instruction.md is empty")
    return HarborTask(str(d.resolve()), instruction, cfg, (d / "solution" / "solve.sh").is_file())


def harbor_to_task(h: HarborTask, *, build_args: Mapping[str, str] | None = None,
                   base_images: Mapping[str, str] | None = None) -> Task:
    """An rlf Task (meta["swe"] with the `harbor` part) for SweEnv."""
    meta: dict[str, Any] = {"swe": {
        "instance_id": h.config.name, "problem_statement": h.instruction, "FAIL_TO_PASS": ["tests/test.sh"],
        "harbor": {"path": h.path, "build_args": dict(build_args or {}), "base_images": dict(base_images or {})},
    }}
    return Task(id=h.config.name, question=h.instruction, meta=meta)


def load_harbor_dir(path: str | os.PathLike[str], *, build_args: Mapping[str, str] | None = None,
                    base_images: Mapping[str, str] | None = None) -> list[Task]:
    """Tasks of a Harbor task directory, or of every task directory directly inside `path`."""
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"Harbor task directory not found: {d}")
    dirs = [d] if (d / "task.toml").is_file() else sorted(p for p in d.iterdir() if (p / "task.toml").is_file())
    if not dirs:
        raise HarborError(f"{d}: no Harbor task (a directory with task.toml) here or directly inside")
    return [harbor_to_task(load_harbor_task(p), build_args=build_args, base_images=base_images) for p in dirs]


def parse_reward(txt: bytes | None, js: bytes | None) -> float | None:
    """The verifier's reward: reward.txt (a number) first, else reward.json (its `reward`, else the mean of its
    numbers); None when neither holds one."""
    if txt is not None:
        try:
            return float(txt.decode("utf-8", "replace").strip().splitlines()[0])
        except (ValueError, IndexError):
            pass
    if js is not None:
        try:
            data = json.loads(js)
        except ValueError:
            return None
        if isinstance(data, int | float) and not isinstance(data, bool):
            return float(data)
        if isinstance(data, dict):
            if isinstance(data.get("reward"), int | float):
                return float(data["reward"])
            nums = [float(v) for v in data.values() if isinstance(v, int | float) and not isinstance(v, bool)]
            if nums:
                return sum(nums) / len(nums)
    return None


def build_docker_image(h: HarborTask, build_args: Mapping[str, str] | None = None, *,
                       keep: bool | None = None) -> str:
    """`docker:<tag>` of the task's image, built from environment/ with the docker SDK (DOCKER_HOST honoured), or
    `[environment] docker_image` as is.

    The tag is the content hash of environment/ and the build args (`rlf-harbor-<name>:<hash>`): an image already in
    the engine under it is reused. The build's log goes to this module's logger at DEBUG (never to stdout); a failed
    build's error holds its tail. Built images carry `rlf.image=1` and this process as owner (the session labels),
    so the docker backend removes them when it closes (`DockerBackend.aclose`) and its reaper removes those whose
    builder is gone; `keep=True` (default: RLF_KEEP_DOCKER_IMAGES=1) labels them `rlf.keep=1` instead: they stay in
    the engine and later runs reuse them by content hash (`docker image prune --filter label=rlf.image` clears
    them). An image in the engine whose (not keeping) builder is gone is rebuilt (from the engine's layer cache) as
    this process's own, so a reaper never takes it from under this run."""
    if h.config.docker_image and not (Path(h.path) / "environment" / "Dockerfile").is_file():
        return f"docker:{h.config.docker_image}"
    try:
        import docker
    except ImportError:
        from rlf_envs.extras import install_hint

        raise HarborError(f"the docker backend needs the docker SDK: {install_hint('docker')}") from None
    import collections
    import logging
    import socket
    import time

    from rlf_envs.sandbox.sessions import owners

    logger = logging.getLogger(__name__)
    if keep is None:
        keep = os.environ.get("RLF_KEEP_DOCKER_IMAGES", "").strip().lower() in ("1", "true", "yes")
    ctx = Path(h.path) / "environment"
    sha = hashlib.sha256(json.dumps(dict(build_args or {}), sort_keys=True).encode())
    for p in sorted(ctx.rglob("*")):
        if p.is_file():
            sha.update(p.relative_to(ctx).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    name = re.sub(r"[^a-z0-9_.-]+", "-", h.config.name.lower()).strip("-.") or "task"
    tag = f"rlf-harbor-{name}:{sha.hexdigest()[:16]}"
    pid = os.getpid()
    labels = {"rlf.image": "1", "rlf.owner.run": owners.RUN_ID, "rlf.owner.pid": str(pid),
              "rlf.owner.start": str(owners.start_time(pid)), "rlf.owner.host": socket.gethostname()}
    if keep:
        labels["rlf.keep"] = "1"
    timeout = float(h.config.build_timeout_s)
    try:
        client = docker.from_env(timeout=int(timeout))
    except Exception as e:
        raise HarborError(f"{h.path}: no docker engine to build the task's image ({e}; see DOCKER_HOST)") from None
    tail: collections.deque[str] = collections.deque(maxlen=40)
    steps: list[str] = []  # the images of the build's steps (the first is the FROM image)
    try:
        old = None
        try:
            img = client.images.get(tag)
            lab = img.labels or {}
            if lab.get("rlf.keep") == "1" or lab.get("rlf.owner.host") != labels["rlf.owner.host"]:
                return f"docker:{tag}"
            try:
                alive = owners.alive(int(lab["rlf.owner.pid"]), int(lab["rlf.owner.start"]))
            except (KeyError, ValueError):
                alive = False
            if alive and not keep:
                return f"docker:{tag}"  # a live run's: reused (its owner removes it at its close)
            old = img.id  # a dead builder's (a reaper would take it) or kept now: rebuilt as ours
        except docker.errors.ImageNotFound:
            pass
        t0 = time.monotonic()
        for chunk in client.api.build(path=str(ctx), tag=tag, buildargs=dict(build_args or {}), rm=True,
                                      forcerm=True, decode=True, labels=labels, timeout=int(timeout)):
            text = str(chunk.get("stream") or chunk.get("status") or "")
            for line in text.splitlines():
                if line.strip():
                    tail.append(line[:500])
                    logger.debug("docker build %s: %s", tag, line[:2000])
                    step = re.fullmatch(r"\s*---> ([0-9a-f]{12,64})\s*", line)
                    if step:
                        steps.append(step.group(1))
            if "error" in chunk or "errorDetail" in chunk:
                msg = chunk.get("error") or (chunk.get("errorDetail") or {}).get("message") or "error"
                raise docker.errors.BuildError(str(msg), [])
            if time.monotonic() - t0 > timeout:
                raise docker.errors.BuildError(f"the build ran past build_timeout_sec={timeout:.0f}", [])
        client.images.get(tag)
        if old is not None and old != client.images.get(tag).id:
            try:
                client.images.remove(old, noprune=False)
            except Exception:  # in use: it goes when its containers do (the reaper)
                pass
    except docker.errors.BuildError as e:
        for step_id in reversed(steps):  # a failed build's untagged step images (never a tagged one: a base)
            try:
                if not client.images.get(step_id).tags:
                    client.images.remove(step_id, noprune=False)
            except Exception:
                pass
        log = "\n".join(tail)[-1500:]
        raise HarborError(f"{h.path}: docker build of environment/Dockerfile failed: {e.msg}\n{log}") from None
    except docker.errors.APIError as e:
        raise HarborError(f"{h.path}: docker build of environment/Dockerfile refused: {e} (is its FROM image "
                          "in the engine? a base image can be named through a build ARG)") from None
    finally:
        client.close()
    return f"docker:{tag}"


def docker_image_workdir(ref: str) -> str | None:
    """The WORKDIR of an engine image (`docker:<tag>` or `<tag>`), None when it sets none."""
    import docker

    client = docker.from_env(timeout=60)
    try:
        wd = (client.images.get(ref.removeprefix("docker:")).attrs.get("Config") or {}).get("WorkingDir")
    finally:
        client.close()
    return wd or None


__all__ = ["DockerPlan", "HarborConfig", "HarborError", "HarborTask", "build_docker_image", "docker_image_workdir",
           "harbor_to_task",
           "load_harbor_dir", "load_harbor_task", "parse_dockerfile", "parse_reward", "parse_task_toml",
           "plan_dockerfile"]
