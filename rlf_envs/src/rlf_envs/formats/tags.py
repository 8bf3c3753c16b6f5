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
    if len(tags) == 1:
        return _one_tag_blocks(text, tags[0])
    return _tag_blocks(text, tags)


def _one_tag_blocks(text: str, tag: str) -> Iterator[TagBlock]:
    """`tag_blocks` for one tag (the common case; kept lean, it runs on every policy turn)."""
    open_, close_ = f"<{tag}>", f"</{tag}>"
    start = text.find(open_)
    while start >= 0:
        inner_start = start + len(open_)
        close = text.find(close_, inner_start)
        if close < 0:
            return
        end = close + len(close_)
        yield TagBlock(tag, start, end, inner_start, close)
        start = text.find(open_, end)


def _tag_blocks(text: str, tags: tuple[str, ...]) -> Iterator[TagBlock]:
    opens = [f"<{t}>" for t in tags]
    closes = [f"</{t}>" for t in tags]
    nxt = [text.find(o) for o in opens]  # next open of each tag at or after the scan position (-1: none left)
    while True:
        k, start = -1, -1
        for j, p in enumerate(nxt):
            if p >= 0 and (k < 0 or p < start):
                k, start = j, p
        if k < 0:
            return
        inner_start = start + len(opens[k])
        close = text.find(closes[k], inner_start)
        if close < 0:  # no close after this open, so none after any later one: this tag is finished
            nxt[k] = -1
            continue
        end = close + len(closes[k])
        yield TagBlock(tags[k], start, end, inner_start, close)
        for j, p in enumerate(nxt):
            if 0 <= p < end:
                nxt[j] = text.find(opens[j], end)


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
