"""Linear-time scanning of `<tag>...</tag>` blocks in a policy turn.

A regex like `<tag>(.*?)</tag>` retries from every unclosed `<tag>`, scanning to the end of the text each
time: quadratic in the action length (a degenerate policy repeating `<tool_call>` 40,000 times froze the
loop for minutes). Here each open tag looks for its close once; if a tag has no close after some open,
it has none after any later open either, so that tag is done. Same matches as the regex, O(len(text)).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple


class TagBlock(NamedTuple):
    """One `<tag>inner</tag>` block: the tag name, where it starts and ends, and the inner text's span."""

    tag: str
    start: int  # index of `<tag>`
    end: int  # index just past `</tag>`
    inner_start: int
    inner_end: int

    def inner(self, text: str) -> str:
        return text[self.inner_start : self.inner_end]


def tag_blocks(text: str, *tags: str) -> Iterator[TagBlock]:
    """The non-overlapping `<tag>...</tag>` blocks of any of `tags`, left to right, each closed by the first
    matching close tag after it (what `re.finditer(r"<(a|b)>(.*?)</\\1>", text, re.DOTALL)` yields)."""
    opens = {t: f"<{t}>" for t in tags}
    closes = {t: f"</{t}>" for t in tags}
    nxt = {t: text.find(opens[t]) for t in tags}  # next open of each tag at or after pos (-1: none)
    pos = 0
    while True:
        live = [t for t in tags if nxt[t] >= 0]
        if not live:
            return
        tag = min(live, key=nxt.__getitem__)
        start = nxt[tag]
        inner_start = start + len(opens[tag])
        close = text.find(closes[tag], inner_start)
        if close < 0:  # no close after this open, so none after any later one: this tag is finished
            nxt[tag] = -1
            continue
        end = close + len(closes[tag])
        yield TagBlock(tag, start, end, inner_start, close)
        pos = end
        for t in live:
            if nxt[t] < pos:
                nxt[t] = text.find(opens[t], pos)


def first_block(text: str, tag: str) -> TagBlock | None:
    """The first `<tag>...</tag>` block, or None."""
    return next(tag_blocks(text, tag), None)


def strip_blocks(text: str, tag: str) -> str:
    """`text` without its `<tag>...</tag>` blocks (like `re.sub(r"<tag>.*?</tag>", "", text, flags=re.DOTALL)`)."""
    parts: list[str] = []
    pos = 0
    for b in tag_blocks(text, tag):
        parts.append(text[pos : b.start])
        pos = b.end
    parts.append(text[pos:])
    return "".join(parts)
