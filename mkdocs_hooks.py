"""MkDocs hooks (mkdocs.yml `hooks:`): the docs build fails on unfinished text, i.e. placeholders and notes meant
for the authors rather than the reader ("TODO", "written on other branches", "(row from the X branch)"), on any
page, in the nav or not. `tests/docs/test_docs_placeholders.py` runs the same check over docs/ and README.md."""

from __future__ import annotations

import re
from typing import Any

#: (pattern, what it is); matched against each line of a page's Markdown
PLACEHOLDERS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"\b(?:TODO|TBD|FIXME|XXX)\b"), "a placeholder"),
    (re.compile(r"\b(?:this|another|other|the `?[\w-]+`?) branch(?:es)?\b(?! of\b)", re.I),
     "a note about the authors' branches"),
    (re.compile(r"\bwritten on (?:other|another)\b", re.I), "a note about pages still being written"),
    (re.compile(r"\blinks? in here\b", re.I), "a note about pages still being written"),
    (re.compile(r"\((?:row|text|section) from the\b", re.I), "a placeholder for text from elsewhere"),
)
#: words that name code branches, not the authors' (`if` branches, dead branches of a record)
_CODE_BRANCH = re.compile(r"\b(?:dead|async|if|else|hot|fast|slow|code) branch(?:es)?\b", re.I)


def find_placeholders(markdown: str) -> list[tuple[int, str, str]]:
    """(line number, what, the line) of each placeholder in `markdown`."""
    out = []
    for n, line in enumerate(markdown.splitlines(), 1):
        for pattern, what in PLACEHOLDERS:
            m = pattern.search(line)
            if m and not (what.endswith("branches") and _CODE_BRANCH.search(line)):
                out.append((n, what, line.strip()))
                break
    return out


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    found = find_placeholders(markdown)
    if found:
        from mkdocs.exceptions import PluginError

        raise PluginError("unfinished text in " + page.file.src_uri + ": " + "; ".join(
            f"line {n}: {what}: {line[:120]!r}" for n, what, line in found))
    return markdown
