"""Every ```python block of the docs (docs/**/*.md, README.md) runs, so the docs cannot rot.

Each block runs as written in a fresh interpreter, from an empty temporary directory, with a deadline, in
the env `tox -e docs` installs (rlf_envs only: no torch, no network). A block that cannot run there (a GPU,
a server, a long run) is preceded by the line `<!-- docs: no-run (reason) -->`; those are listed with their
reason in the test report. ```bash / ```text blocks are not run; a ```yaml block that is a training
config (it has a top-level `backend:` key) is validated with rlf_train's own config model (pydantic and
yaml only, no torch). New pages are picked up automatically. Run by `tox -e docs` (which sets
RLF_DOCS_SNIPPETS=1); elsewhere skipped with the reason.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from repo_paths import REPO

ROOT = REPO
DEADLINE_S = 120  # per block; they take about a second each (a hang guard, not a speed limit)
NO_RUN = re.compile(r"<!--\s*docs:\s*no-run\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.DOTALL | re.MULTILINE)

pytestmark = pytest.mark.skipif(
    not os.environ.get("RLF_DOCS_SNIPPETS"), reason="run by `tox -e docs` (set RLF_DOCS_SNIPPETS=1 to run here)")
CONFIG_CHECK = f"""
import sys, yaml
sys.path.insert(0, {str(ROOT / "rlf_train" / "src")!r})  # rlf_train.config needs pydantic and yaml, not torch
from rlf_train.config import config_from_dict
config_from_dict(yaml.safe_load(sys.stdin.read()))
assert "torch" not in sys.modules
"""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    code: str
    no_run: str | None  # the reason, when the block is marked not to run

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(text: str, path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, with the no-run marker on the nearest non-blank line above."""
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip().rsplit("\n", 1)[-1]
        marker = NO_RUN.search(before)
        indent = m.group("indent")
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line
                         for line in m.group("body").split("\n"))
        out.append(Block(path, text.count("\n", 0, m.start()) + 1, m.group("lang").lower(), code,
                         marker.group("reason").strip() if marker else None))
    return out


def doc_files() -> list[Path]:
    return [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


def python_blocks() -> list[Block]:
    return [b for p in doc_files() for b in blocks(p.read_text(encoding="utf-8"), p) if b.lang in ("python", "py")]


ALL = python_blocks()
RUN = [b for b in ALL if b.no_run is None]
CONFIGS = [b for p in doc_files() for b in blocks(p.read_text(encoding="utf-8"), p)
           if b.lang in ("yaml", "yml") and b.no_run is None and re.search(r"^backend:", b.code, re.MULTILINE)]


def test_the_extractor_sees_fences_markers_and_languages(tmp_path: Path) -> None:
    md = tmp_path / "x.md"
    text = ("intro\n```python\nprint(1)\n```\n\n<!-- docs: no-run (needs a GPU) -->\n\n```python\nimport torch\n```\n"
            "```bash\nrm -rf /\n```\n- item:\n  ```python\n  x = 1\n  assert x\n  ```\n")
    got = blocks(text, md)
    assert [(b.lang, b.line, b.no_run) for b in got] == [
        ("python", 2, None), ("python", 8, "needs a GPU"), ("bash", 11, None), ("python", 15, None)]
    assert got[0].code == "print(1)\n" and got[3].code == "x = 1\nassert x\n"


def test_every_page_is_scanned_and_there_is_something_to_run() -> None:
    assert len(RUN) >= 5, [b.id for b in ALL]
    scanned = {b.path for b in ALL}
    assert ROOT / "README.md" in scanned and ROOT / "docs" / "concepts.md" in scanned


def test_no_run_blocks_are_listed_with_a_reason() -> None:
    skipped = [(b.id, b.no_run) for b in ALL if b.no_run is not None]
    for bid, reason in skipped:
        assert reason and len(reason) >= 3, f"{bid}: say why the block cannot run"
    lines = [f"  {bid}: {reason}" for bid, reason in skipped] or ["  none"]
    print("\nno-run blocks:", *lines, sep="\n")


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    if block.no_run is not None:
        pytest.skip(f"{block.id}: docs: no-run ({block.no_run})")  # listed in the report's skip summary (-ra)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    # A block runs as from a checkout's root (paths to shipped files such as configs/ or the tokenizers under
    # rlf_train/src/.../assets resolve), but in a scratch directory, so what it writes never lands in the repo.
    for name in ("rlf_envs", "rlf_train", "configs", "servers", "templates"):
        (tmp_path / name).symlink_to(ROOT / name)
    try:
        proc = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.id}: still running after {DEADLINE_S} s; mark it "
                    "`<!-- docs: no-run (reason) -->` if it cannot run offline in seconds")
    assert proc.returncode == 0, (
        f"{block.id} failed (exit {proc.returncode}); fix the block, or mark it "
        f"`<!-- docs: no-run (reason) -->` if it cannot run offline on a CPU:\n{proc.stderr[-3000:]}")


def test_there_is_a_training_config_to_check() -> None:
    assert any(b.path == ROOT / "README.md" for b in CONFIGS), "README's training config is no longer found"


@pytest.mark.parametrize("block", CONFIGS, ids=[b.id for b in CONFIGS])
def test_training_config_block_is_valid(block: Block) -> None:
    proc = subprocess.run([sys.executable, "-c", CONFIG_CHECK], input=block.code, capture_output=True, text=True,
                          timeout=DEADLINE_S)
    assert proc.returncode == 0, f"{block.id}: not a valid rlf_train config:\n{proc.stderr[-3000:]}"
