"""Shared test setup: which folders this install can run, slow/GPU tests skipped by default with a visible reason."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
SEARCH_CORPUS = ROOT / "rlf_envs" / "src" / "rlf_envs" / "data" / "search" / "corpus.jsonl"


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# tests/NAME/ is what `tox -e NAME` runs (tests/README.md). A folder whose install is not this one (e.g. tests/train
# in the `envs` env, which has no torch by design) is not collected by a bare `pytest`; the report header says why.
_NEEDS = {
    "train": ("torch", "transformers"),
    "retrieval": ("faiss", "bm25s", "sentence_transformers"),
    "vllm": ("torch", "openrlhf"),
    "adapters": ("trl", "verifiers"),
    "adapters-rl": ("skyrl_gym", "verl", "openenv"),
    "adapters-rl-nemo": ("nemo_gym",),
    "docs": ("mkdocs",),
}
_MISSING = {folder: [m for m in mods if not _has(m)] for folder, mods in _NEEDS.items()}
# support/: helper modules, assets and Harbor task directories (their tests/ run inside a session, never here)
collect_ignore = ["support", "mutation", *[folder for folder, missing in _MISSING.items() if missing]]


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"not collected: tests/{f}/ (no {', '.join(m)} here: tox -e {f})" for f, m in _MISSING.items() if m]


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


def _live_processes_with(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if marker.encode() in cmd and state != "Z":
            found.append(int(pid))
    return found


@pytest.fixture
def leftovers() -> Callable[[str], list[int]]:
    """For process-leak tests: `leftovers(marker)` waits up to 5 s for the live (non-zombie) processes whose
    command line holds `marker` to go, and returns those still there."""

    def wait(marker: str) -> list[int]:
        deadline = time.monotonic() + 5
        while (alive := _live_processes_with(marker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return alive

    return wait


_guards: dict[str, str] | None = None


def sandbox_guards() -> dict[str, str]:
    """The sandbox guards this machine allows (probed once with a trivial run)."""
    global _guards
    if _guards is None:
        import asyncio

        from rlf_envs.sandbox import run_python

        result = asyncio.run(run_python("pass"))
        _guards = {**{k: f"missing: {v}" for k, v in result.missing_guards.items()}, **result.guards}
        _guards["_isolated"] = "yes" if ("pid_ns" in result.guards or "uid" in result.guards) else ""
    return _guards


@pytest.fixture
def isolated() -> None:
    """Skip (with the reason) unless the sandbox can separate code from us here: a pid namespace or, as root,
    a uid of the run's own. Without either (not root, no user namespaces) the code runs as our uid."""
    g = sandbox_guards()
    if not g["_isolated"]:
        pytest.skip(f"no pid namespace and no uid switch here ({g.get('pid_ns', '')}; {g.get('uid', '')})")


QWEN3_TEMPLATE = ROOT / "tests" / "support" / "assets" / "qwen3_chat_template.jinja"  # Apache-2.0: NOTICE.md


@pytest.fixture(scope="session")
def qwen3_template_tokenizer():  # type: ignore[no-untyped-def]
    """A transformers tokenizer with Qwen3's chat template and a tiny byte-level vocabulary (for rendering)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=280, special_tokens=["<|im_start|>", "<|im_end|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello"], trainer)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    hf.chat_template = QWEN3_TEMPLATE.read_text(encoding="utf-8")
    return hf


def stop_process(proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """SIGTERM, wait, then SIGKILL: a test's server subprocess is always reaped."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture
def chat_server() -> Iterator[Any]:
    """`chat_server(**kw)` starts a scripted OpenAI-compatible chat server on loopback
    (tests/support/servers/fake_openai.py) and returns it; all are stopped after the test."""
    from tests.support.servers.fake_openai import FakeChatServer, RunningServer

    started: list[RunningServer] = []

    def start(**kw: Any) -> FakeChatServer:
        fake = FakeChatServer(**kw)
        started.append(RunningServer(fake))
        return fake

    yield start
    for s in started:
        s.stop()
