"""SWE tasks: the typed task, loaders (rlf's shipped tasks, SWE-bench-style JSONL) and the repository on disk.

A row is SWE-bench's shape: `instance_id`, `problem_statement`, `patch` (the gold fix), `test_patch` (tests
the fix needs; applied before the hidden run, never shown), `FAIL_TO_PASS`, `PASS_TO_PASS` (lists, or JSON
strings of lists as on the Hugging Face copies). Where the repository comes from, first match wins:
`repo_dir` (a directory holding the repository at its base state), `image` (a session image holding it at
`workdir`, e.g. `docker:swebench/sweb.eval.x86_64.<id>` with `/testbed`), or for rlf's shipped tasks `repo`
naming one of `rlf_envs/data/swe/repos/<repo>.tar.gz`. rlf's rows also carry `bug_patch` (applied to the
base to make the broken repository) and the hidden `mutation`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from rlf_envs.types import Task

DEFAULT_TEST_CMD = "python3 -m pytest -p no:cacheprovider -o addopts= -q"
_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class SweTask:
    """One repair task (SWE-bench field names)."""

    instance_id: str
    problem_statement: str
    FAIL_TO_PASS: tuple[str, ...]
    PASS_TO_PASS: tuple[str, ...] = ()
    patch: str = ""  # the gold fix (diff of the broken repository)
    test_patch: str = ""  # applied in the hidden run only
    bug_patch: str = ""  # applied to the base repository to make the task's starting state
    repo: str = ""
    repo_dir: str | None = None  # host directory of the repository at its base state
    image: str = "host"  # the session image (rlf's shipped tasks: the host's tools, or a Debian root)
    workdir: str = "/workspace"
    pythonpath: str = "."  # the import root inside the repository, put on PYTHONPATH for the tests
    test_cmd: str = DEFAULT_TEST_CMD
    #: a Harbor task: {"path": task dir, "build_args": {...}, "base_images": {...}} (`rlf_envs.tasks.harbor`)
    harbor: dict[str, Any] | None = None
    #: the agent's workspace keeps the repository's git history (default: one commit of the starting state, so
    #: `git log --all` cannot show the fix)
    keep_history: bool = False

    def to_meta(self) -> dict[str, Any]:
        return {"swe": {
            "instance_id": self.instance_id, "problem_statement": self.problem_statement,
            "FAIL_TO_PASS": list(self.FAIL_TO_PASS), "PASS_TO_PASS": list(self.PASS_TO_PASS), "patch": self.patch,
            "test_patch": self.test_patch, "bug_patch": self.bug_patch, "repo": self.repo,
            "repo_dir": self.repo_dir, "image": self.image, "workdir": self.workdir,
            "pythonpath": self.pythonpath, "test_cmd": self.test_cmd, "harbor": self.harbor,
            "keep_history": self.keep_history}}

    @classmethod
    def from_meta(cls, task: Task) -> SweTask:
        d = task.meta.get("swe")
        if not isinstance(d, Mapping):
            raise ValueError(f"task {task.id!r} is not a SWE task (no meta['swe']); load it with "
                             "rlf_envs.envs.swe.tasks.load_swe_jsonl or give SWE-bench-style rows")
        return swe_task_from_row(d)


def _test_list(value: Any, where: str, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):  # the Hugging Face copies store them as JSON strings
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{where}: {key} must be a list of test ids (or a JSON string of one)") from None
    if not isinstance(value, list | tuple) or not all(isinstance(x, str) and x for x in value):
        raise ValueError(f"{where}: {key} must be a list of non-empty test id strings")
    return tuple(value)


def swe_task_from_row(row: Mapping[str, Any], where: str = "row", base_dir: Path | None = None) -> SweTask:
    """A SweTask from a SWE-bench-style mapping; ValueError naming the row and field for bad input."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    iid = row.get("instance_id")
    if not isinstance(iid, str) or not iid.strip():
        raise ValueError(f"{where}: needs a non-empty string 'instance_id'")
    where = f"{where} ({iid})"
    ps = row.get("problem_statement")
    if not isinstance(ps, str) or not ps.strip():
        raise ValueError(f"{where}: needs a non-empty string 'problem_statement'")
    f2p = _test_list(row.get("FAIL_TO_PASS"), where, "FAIL_TO_PASS")
    if not f2p:
        raise ValueError(f"{where}: FAIL_TO_PASS is empty: a task needs at least one test the fix makes pass")
    p2p = _test_list(row.get("PASS_TO_PASS"), where, "PASS_TO_PASS")
    strs = {}
    for key in ("patch", "test_patch", "bug_patch", "repo", "image", "workdir", "pythonpath", "test_cmd"):
        v = row.get(key)
        if v is not None and not isinstance(v, str):
            raise ValueError(f"{where}: {key} must be a string, got {type(v).__name__}")
        strs[key] = v
    repo_dir = row.get("repo_dir")
    if repo_dir is not None:
        if not isinstance(repo_dir, str):
            raise ValueError(f"{where}: repo_dir must be a path string")
        p = Path(repo_dir) if base_dir is None else base_dir / repo_dir
        if not p.is_dir():
            raise ValueError(f"{where}: repo_dir {str(p)!r} is not a directory")
        repo_dir = str(p.resolve())
    harbor = row.get("harbor")
    if harbor is not None and (not isinstance(harbor, Mapping) or not isinstance(harbor.get("path"), str)):
        raise ValueError(f"{where}: harbor must be an object with the task directory's 'path'")
    keep_history = row.get("keep_history", False)
    if not isinstance(keep_history, bool):
        raise ValueError(f"{where}: keep_history must be true or false")
    workdir = strs["workdir"] or ("/testbed" if (strs["image"] or "").startswith("docker:") else "/workspace")
    if not PurePosixPath(workdir).is_absolute():
        raise ValueError(f"{where}: workdir must be an absolute path inside the session, got {workdir!r}")
    return SweTask(
        instance_id=iid, problem_statement=ps, FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p,
        patch=strs["patch"] or "", test_patch=strs["test_patch"] or "", bug_patch=strs["bug_patch"] or "",
        repo=strs["repo"] or "", repo_dir=repo_dir, image=strs["image"] or "host", workdir=workdir,
        pythonpath=strs["pythonpath"] or ".", test_cmd=strs["test_cmd"] or DEFAULT_TEST_CMD,
        harbor=dict(harbor) if harbor is not None else None, keep_history=keep_history,
    )


INSTRUCTIONS = (
    "\n\nThe repository is checked out in {workdir} (your shell starts there). Find the cause, fix the library "
    "code, and run the failing tests to check your fix. Test files are restored before grading, so changing "
    "them does not help. Call submit() when you are done."
)


def to_task(t: SweTask) -> Task:
    """The rlf Task of a SweTask (the prompt is the issue text plus how the workspace is laid out)."""
    return Task(id=t.instance_id, question=t.problem_statement + INSTRUCTIONS.format(workdir=t.workdir),
                ground_truth=None, meta=t.to_meta())


def load_swe_rows(rows: Iterable[Mapping[str, Any]], where: str = "rows",
                  base_dir: Path | None = None) -> list[Task]:
    return [to_task(swe_task_from_row(r, f"{where} #{i}", base_dir)) for i, r in enumerate(rows)]


def load_swe_jsonl(path: str | os.PathLike[str]) -> list[Task]:
    """Tasks from a SWE-bench-style JSONL (or a JSON array) file; relative `repo_dir`s are from the file's dir."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"SWE task file not found: {p}")
    text = p.read_text(encoding="utf-8")
    rows: list[Any] = []
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{p}: not JSON ({e})") from None
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"{p}:{lineno}: not JSON ({e})") from None
    if not rows:
        raise ValueError(f"{p}: no tasks")
    from rlf_envs.sandbox import hide_from_runs

    hide_from_runs(p)  # gold patches and hidden tests: never readable from a sandboxed run
    return load_swe_rows(rows, str(p), p.parent)


# -- shipped tasks and the repositories on disk ------------------------------------------------------------------

_SHIPPED: dict[str, tuple[Task, ...]] = {}


def shipped_projects() -> dict[str, dict[str, Any]]:
    from rlf_envs.data.swe import DATA_DIR

    data: dict[str, dict[str, Any]] = json.loads((DATA_DIR / "projects.json").read_text(encoding="utf-8"))
    return data


def shipped_tasks(split: str = "train") -> list[Task]:
    """rlf's shipped tasks of `split` ("train" or "test")."""
    from rlf_envs.data.swe import split_path

    with _LOCK:
        if split not in _SHIPPED:
            projects = shipped_projects()
            rows = [json.loads(line) for line in split_path(split).read_text(encoding="utf-8").splitlines()
                    if line.strip()]
            for r in rows:
                r.setdefault("pythonpath", projects[r["repo"]]["pythonpath"])
            _SHIPPED[split] = tuple(load_swe_rows(rows, str(split_path(split))))
        return list(_SHIPPED[split])


def cache_dir() -> Path:
    return Path(os.environ.get("RLF_CACHE_DIR") or Path.home() / ".cache" / "rlf")


def apply_patch_host(repo: Path, patch: str, what: str, timeout_s: float = 60.0) -> None:
    """`git apply` a trusted patch (from the task data) to a host directory; ValueError when it does not apply."""
    if not patch.strip():
        return
    with tempfile.NamedTemporaryFile("w", suffix=".patch", delete=False, encoding="utf-8") as f:
        f.write(patch)
    try:
        r = subprocess.run(["git", "apply", "--whitespace=nowarn", f.name], cwd=repo,
                           capture_output=True, text=True, timeout=timeout_s,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1",
                                "HOME": str(repo), "GIT_CEILING_DIRECTORIES": str(repo.parent)})
        if r.returncode != 0:
            raise ValueError(f"{what} does not apply to {repo}: {r.stderr.strip()[:500]}")
    finally:
        os.unlink(f.name)


def _extract(archive: Path, dest: Path) -> None:
    with tarfile.open(archive) as tf:
        tf.extractall(dest, filter="data")


def _private_dir(d: Path) -> None:
    """`d` (made if missing) 0700: the seed copies under it are neither readable nor traversable by a session's uid
    (the local backend's agent, root, copies and binds them before the session's root is entered)."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.lstat()
    if st.st_uid == os.geteuid() and st.st_mode & 0o777 != 0o700:
        os.chmod(d, 0o700)


def repo_for(t: SweTask) -> Path | None:
    """The host directory holding the task's starting repository (base + bug_patch), built once in rlf's cache
    dir; None when the repository lives in the task's image."""
    if t.repo_dir is None and not t.bug_patch and t.image != "host":
        return None
    if t.repo_dir is not None:
        base = Path(t.repo_dir)
        key = f"dir:{base}"
    else:
        from rlf_envs.data.swe import DATA_DIR

        archive = DATA_DIR / "repos" / f"{t.repo}.tar.gz"
        if not archive.is_file():
            raise FileNotFoundError(f"task {t.instance_id!r}: no repository: give repo_dir, an image, or repo "
                                    f"naming one of {sorted(p.name for p in (DATA_DIR / 'repos').glob('*.tar.gz'))}")
        key = f"archive:{hashlib.sha256(archive.read_bytes()).hexdigest()}"
        base = cache_dir() / "swe" / f"base-{key[8:24]}"
        with _LOCK:
            _private_dir(base.parent)
            if not base.is_dir():
                tmp = Path(tempfile.mkdtemp(dir=base.parent))
                _extract(archive, tmp)
                try:
                    os.replace(tmp, base)
                except OSError:
                    shutil.rmtree(tmp, ignore_errors=True)  # a concurrent builder won
    if not t.bug_patch:
        return base if t.keep_history or not (base / ".git").exists() else _without_history(base, key)
    digest = hashlib.sha256(f"{key}\0{t.bug_patch}".encode()).hexdigest()[:16]
    out = cache_dir() / "swe" / f"task-{digest}"
    with _LOCK:
        _private_dir(out.parent)
        if not out.is_dir():
            tmp = Path(tempfile.mkdtemp(dir=out.parent))
            try:
                shutil.copytree(base, tmp / "repo", symlinks=True)
                apply_patch_host(tmp / "repo", t.bug_patch, f"task {t.instance_id!r}: bug_patch")
                os.replace(tmp / "repo", out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out if t.keep_history or not (out / ".git").exists() else _without_history(out, f"{key}\0{t.bug_patch}")


#: the shell step that gives a repository held by the task's image one commit of its starting state (run at the
#: workspace's start unless the task keeps its history); $1 is the workdir
HIDE_HISTORY = r"""cd "$1" 2>/dev/null || exit 0
[ -e .git ] || exit 0
rm -rf .git
command -v git >/dev/null 2>&1 || exit 0
git init -q && git add -A && git -c user.name=rlf -c user.email=rlf@localhost -c commit.gpgsign=false commit -q \
  --no-verify -m "the task's starting state" >/dev/null 2>&1
exit 0
"""


def _head(repo: Path) -> str:
    """The commit HEAD names (read from .git, no git needed), or "" when it cannot be read."""
    try:
        head = (repo / ".git" / "HEAD").read_text().strip()
        if head.startswith("ref: "):
            ref = repo / ".git" / head[5:]
            return ref.read_text().strip() if ref.is_file() else head
        return head
    except OSError:
        return ""


def _without_history(src: Path, key: str) -> Path:
    """A copy of `src` whose git history is one commit of its tree (built once in rlf's cache dir): the agent's
    workspace cannot read the fix from later commits, other refs or the reflog."""
    digest = hashlib.sha256(f"{key}\0{_head(src)}\0nohist".encode()).hexdigest()[:16]
    out = cache_dir() / "swe" / f"nohist-{digest}"
    with _LOCK:
        _private_dir(out.parent)
        if out.is_dir():
            return out
        tmp = Path(tempfile.mkdtemp(dir=out.parent))
        try:
            shutil.copytree(src, tmp / "repo", symlinks=True, ignore=shutil.ignore_patterns(".git"))
            if shutil.which("git"):
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_CONFIG_NOSYSTEM": "1",
                       "HOME": str(tmp), "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
                       "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z", "GIT_CEILING_DIRECTORIES": str(tmp)}
                for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                            ["git", "-c", "user.name=rlf", "-c", "user.email=rlf@localhost", "-c",
                             "commit.gpgsign=false", "commit", "-q", "--no-verify", "-m", "the task's starting state"]):
                    subprocess.run(cmd, cwd=tmp / "repo", env=env, capture_output=True, timeout=600, check=True)
            os.replace(tmp / "repo", out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


__all__ = ["DEFAULT_TEST_CMD", "HIDE_HISTORY", "SweTask", "apply_patch_host", "load_swe_jsonl", "load_swe_rows",
           "repo_for", "shipped_tasks", "swe_task_from_row", "to_task"]
