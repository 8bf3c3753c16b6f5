"""rlf's BM25 path never imports jax (issue 37): bm25s' `selection.py` imports `jax.lax` and runs a top-k at import
when jax is importable, and jax then pre-allocates 75% of every GPU (the policy's memory on a training machine).

The check does not need a real jax: a fake `jax` package first on the child's sys.path records any import of it
(a file) and fails it, so the test fails whenever anything on the BM25 path imports jax, installed or not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("bm25s", reason="needs rlf-envs[search] (bm25s)")


CHILD = r"""
import json, os, sys
from pathlib import Path
from rlf_envs.retrieval import build_index, load_index
from rlf_envs.envs.search import default_index_dir
from rlf_envs.data.search import CORPUS_PATH as corpus

tmp = Path(sys.argv[1])
build_index(corpus, tmp / "idx", kind="bm25", show_progress=False)
hits = load_index(tmp / "idx").search_batch(["who wrote the opera", "capital city river"], 3)
os.environ["RLF_CACHE_DIR"] = str(tmp / "cache")
default_index_dir()  # the Search env's default in-process index (its own bm25s check)
print(json.dumps({"hits": [len(h) for h in hits], "jax": sorted(m for m in sys.modules if m.split(".")[0] == "jax")}))
"""

FAKE_JAX = """
from pathlib import Path
Path({marker!r}).write_text("imported")
raise ImportError("fake jax (tests/retrieval/test_retrieval_no_jax.py): the BM25 path must not import jax")
"""


def fake_jax(tmp: Path) -> tuple[Path, Path]:
    site, marker = tmp / "fakejax", tmp / "jax-imported"
    (site / "jax").mkdir(parents=True)
    (site / "jax" / "__init__.py").write_text(FAKE_JAX.format(marker=str(marker)))
    (site / "jax" / "lax.py").write_text("")
    return site, marker


def run_child(tmp_path: Path, site: Path) -> dict[str, list]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *[p for p in sys.path if p]])}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bm25_build_load_search_never_import_jax(tmp_path: Path) -> None:
    site, marker = fake_jax(tmp_path)
    got = run_child(tmp_path, site)
    assert got["hits"] == [3, 3]
    assert not marker.exists(), "something on rlf's BM25 path imported jax"
    assert got["jax"] == []


def test_the_fake_jax_is_seen_by_a_plain_bm25s_import(tmp_path: Path) -> None:
    """The check above can fail: a plain `import bm25s` in the same child setup does import (the fake) jax."""
    site, marker = fake_jax(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *[p for p in sys.path if p]])}
    proc = subprocess.run([sys.executable, "-c", "import bm25s"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert marker.exists()
