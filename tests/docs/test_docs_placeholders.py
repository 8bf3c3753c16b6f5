"""No page of the docs (nor README.md, nor mkdocs.yml's comments) carries unfinished text: placeholders and notes
meant for the authors, as "(row from the `adapters-rl` branch)" and "written on other branches; they link in
here" were. `tox -e docs` fails on them through mkdocs_hooks.py; this runs the same check in the test suite."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from repo_paths import REPO

from mkdocs_hooks import find_placeholders, on_page_markdown

ROOT = REPO


def test_no_page_has_unfinished_text() -> None:
    pages = [*sorted(ROOT.glob("docs/**/*.md")), ROOT / "README.md", ROOT / "mkdocs.yml"]
    assert len(pages) > 20
    found = [f"{p.relative_to(ROOT)}:{n}: {what}: {line}" for p in pages
             for n, what, line in find_placeholders(p.read_text(encoding="utf-8"))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("text", [
    "| SkyRL (`skyrl-gym`) | (row from the `adapters-rl` branch) | | |",
    "Adapters are documented under `docs/integrations/` (written on other branches; they link in here).",
    "Pages written on other branches link in here: `docs/guides/real-vllm.md`",
    "(`docs/performance-tools.md`, written on another branch; it links in here).",
    "116.8 s for this branch against 104.6 s before it",
    "TODO: fill in the numbers",
])
def test_the_check_finds_the_issues_placeholders(text: str) -> None:
    assert find_placeholders("fine line\n" + text)[0][0] == 2


@pytest.mark.parametrize("text", [
    "run_rl's async branch, _save's data_state", "dead branches: every update runs at least one micro-batch",
    "a todo list", "the branch-free parser",
])
def test_the_check_leaves_ordinary_text_alone(text: str) -> None:
    assert find_placeholders(text) == []


def test_the_hook_fails_the_build() -> None:
    pytest.importorskip("mkdocs")
    from mkdocs.exceptions import PluginError

    page = SimpleNamespace(file=SimpleNamespace(src_uri="integrations/index.md"))
    assert on_page_markdown("all good", page, None, None) == "all good"
    with pytest.raises(PluginError, match=r"unfinished text in integrations/index.md: line 1"):
        on_page_markdown("| verl | (row from the `adapters-rl` branch) |", page, None, None)
