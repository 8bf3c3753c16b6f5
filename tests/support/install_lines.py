"""Every `pip install` line a user sees (README, the docs, the servers' README, docstrings and error messages in
the sources) and a check that it can work as written from a checkout: rlf's own distributions are on no package
index, so they must be named by their folder (from the checkout's root, or by an absolute path as the hints
print it), with every extra they name declared, and with each local package's local dependencies on the same
line (`pip install -e ./rlf_train` alone cannot find `rlf-envs`). Used by tests/envs/test_install_lines.py."""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: rlf's distributions: on no index, installable only from their folder
OWN = {"rlf-envs": "rlf_envs", "rlf-train": "rlf_train", "rlf-retrieval-server": "servers"}
#: every distribution a folder of the checkout defines (rlf's own, the env-package template's): none is on an index
LOCAL_NAMES = {re.sub(r"[-_.]+", "-", tomllib.loads(p.read_text(encoding="utf-8"))["project"]["name"]).lower(): p.parent
               for p in ROOT.glob("**/pyproject.toml")
               if ".tox" not in p.parts and "project" in tomllib.loads(p.read_text(encoding="utf-8"))}
#: options of `pip install` that take a value
VALUED = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url", "-f",
          "--find-links", "-t", "--target", "--prefix", "--root"}
#: what the user reads: prose and code blocks of the docs, and the sources (docstrings, error messages)
SOURCES = ("README.md", "docs/**/*.md", "servers/retrieval/README.md", "rlf_envs/src/**/*.py", "rlf_train/src/**/*.py",
           "servers/**/*.py")
_LINE = re.compile(r"pip install ((?:[^`\"\n#(]|'[^'\n]*')+)")


@dataclass(frozen=True)
class InstallLine:
    where: str  # file:line
    args: str  # what follows `pip install`

    def __str__(self) -> str:
        return f"{self.where}: pip install {self.args}"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def find_lines() -> list[InstallLine]:
    out = []
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            text = path.read_text(encoding="utf-8")
            text = re.sub(r"\\\n\s*", " ", text)  # shell line continuations: one command
            for n, line in enumerate(text.splitlines(), 1):
                for m in _LINE.finditer(line):
                    args = m.group(1).strip().rstrip(".,;:")
                    if path.suffix == ".py" and "{" in args:
                        continue  # a template (an f-string): its outputs are checked by calling the code
                    # `pip install` in prose ("a plain `pip install openrlhf` needs flash-attn") is still a line
                    out.append(InstallLine(f"{path.relative_to(ROOT)}:{n}", args))
    return out


def _pyproject(folder: Path) -> dict:  # type: ignore[type-arg]
    return tomllib.loads((folder / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _req_name(req: str) -> tuple[str, set[str]]:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", req)
    if m is None:
        raise ValueError(f"not a requirement: {req!r}")
    return _norm(m.group(1)), {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}


def problems(line: InstallLine, cwd: Path = ROOT) -> list[str]:
    """Why `line` cannot work as written from a checkout at `cwd` (empty: it can)."""
    try:
        words = shlex.split(line.args)
    except ValueError as e:
        return [f"cannot be parsed as a shell command ({e})"]
    out: list[str] = []
    local: dict[str, set[str]] = {}  # distribution -> extras, of the local folders on the line
    needs: list[tuple[str, str, set[str]]] = []  # (who, distribution, extras) of rlf's own requirements
    skip = False
    for w in words:
        if w in ("&&", "||", ";", "|"):  # the next command
            break
        if skip:
            skip = False
            continue
        if w in VALUED:
            skip = True
            continue
        if w.startswith("-"):
            continue
        if w.startswith((".", "/", "~")):
            m = re.fullmatch(r"(.+?)(?:\[([^\]]*)\])?", w)
            assert m is not None
            folder = (cwd / Path(m.group(1)).expanduser()).resolve()
            if not (folder / "pyproject.toml").is_file():
                out.append(f"{m.group(1)} is not a project folder of the checkout")
                continue
            proj = _pyproject(folder)
            extras = {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
            declared = set(proj.get("optional-dependencies", {}))
            out += [f"{m.group(1)} declares no extra {e!r} (it has {sorted(declared)})" for e in extras - declared]
            name = _norm(proj["name"])
            local.setdefault(name, set()).update(extras)
            reqs = list(proj.get("dependencies", []))
            for e in extras & declared:
                reqs += proj["optional-dependencies"][e]
            for r in reqs:
                dep, dep_extras = _req_name(r)
                if dep in OWN and dep != name:
                    needs.append((m.group(1), dep, dep_extras))
            continue
        dist, extras = _req_name(w)
        if dist in LOCAL_NAMES:
            folder = LOCAL_NAMES[dist].relative_to(ROOT)
            out.append(f"{w!r}: {dist} is on no package index; name its folder (-e './{folder}"
                       + (f"[{','.join(sorted(extras))}]" if extras else "") + "') from the checkout's root")
    for who, dep, dep_extras in needs:
        if dep not in local:
            out.append(f"{who} needs {dep}, which no index has: put ./{OWN[dep]} on the same line")
        else:
            folder = ROOT / OWN[dep]
            missing = dep_extras - set(_pyproject(folder).get("optional-dependencies", {}))
            out += [f"{who} needs {dep}[{e}], which ./{OWN[dep]} does not declare" for e in missing]
    return out
