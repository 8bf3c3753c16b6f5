"""Shared test setup: slow/GPU tests are skipped by default with a visible reason."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
SEARCH_CORPUS = ROOT / "rlf_envs" / "src" / "rlf_envs" / "data" / "search" / "corpus.jsonl"


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# Test files whose area needs packages this environment lacks are not collected (e.g. the `envs` tox env has
# no torch by design); the report header says which.
_MISSING = {
    "test_train_*.py": "torch" if not _has("torch") else None,
    "test_retrieval_*.py": "faiss/bm25s" if not (_has("faiss") and _has("bm25s")) else None,
}
collect_ignore_glob = [pattern for pattern, missing in _MISSING.items() if missing]


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"not collected: {p} (no {m} here)" for p, m in _MISSING.items() if m]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = config.getoption("--runslow") or os.environ.get("RLF_SLOW") == "1"
    try:
        import torch

        has_gpu = bool(torch.cuda.is_available())
    except Exception:
        has_gpu = False
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow test: run with RLF_SLOW=1 or --runslow"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (none visible)"))


@pytest.fixture(scope="session")
def bm25_index_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BM25 index of the shipped search corpus, built once per session. Read-only: tests that rebuild
    or overwrite an index make their own."""
    from rlf_envs.retrieval import build_index

    out = tmp_path_factory.mktemp("bm25") / "idx"
    build_index(SEARCH_CORPUS, out, kind="bm25", show_progress=False)
    return out


@pytest.fixture
def chat_server() -> Iterator[Any]:
    """`chat_server(**kw)` starts a scripted OpenAI-compatible chat server on loopback
    (tests/servers/fake_openai.py) and returns it; all are stopped after the test."""
    from tests.servers.fake_openai import FakeChatServer, RunningServer

    started: list[RunningServer] = []

    def start(**kw: Any) -> FakeChatServer:
        fake = FakeChatServer(**kw)
        started.append(RunningServer(fake))
        return fake

    yield start
    for s in started:
        s.stop()
