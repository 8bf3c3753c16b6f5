"""Linear-time scanning of `<tag>...</tag>` blocks in a policy turn.

A regex like `<tag>(.*?)</tag>` retries from every unclosed `<tag>`, scanning to the end of the text each
time: quadratic in the action length (a degenerate policy repeating `<tool_call>` 40,000 times froze the
loop for minutes). Here each open tag looks for its close once; if a tag has no close after some open,
it has none after any later open either, so that tag is done. Same matches as the regex, O(len(text)).
These run on every policy turn, so they are plain loops over `str.find` returning plain strings.
"""

from __future__ import annotations

from collections.abc import Iterator


def inners(text: str, tag: str) -> list[str]:
    """The inner texts of the `<tag>...</tag>` blocks, left to right (what
    `re.findall(r"<tag>(.*?)</tag>", text, re.DOTALL)` gives)."""
    open_, close_ = f"<{tag}>", f"</{tag}>"
    out: list[str] = []
    start = text.find(open_)
    while start >= 0:
        inner = start + len(open_)
        close = text.find(close_, inner)
        if close < 0:  # no close after this open, so none after any later one
            break
        out.append(text[inner:close])
        start = text.find(open_, close + len(close_))
    return out


def first_inner(text: str, tag: str) -> str | None:
    """The inner text of the first `<tag>...</tag>` block, or None."""
    open_ = f"<{tag}>"
    start = text.find(open_)
    if start < 0:
        return None
    inner = start + len(open_)
    close = text.find(f"</{tag}>", inner)
    return None if close < 0 else text[inner:close]


def strip_blocks(text: str, tag: str) -> str:
    """`text` without its `<tag>...</tag>` blocks (like `re.sub(r"<tag>.*?</tag>", "", text, flags=re.DOTALL)`)."""
    open_, close_ = f"<{tag}>", f"</{tag}>"
    parts: list[str] = []
    pos = 0
    start = text.find(open_)
    while start >= 0:
        close = text.find(close_, start + len(open_))
        if close < 0:
            break
        parts.append(text[pos:start])
        pos = close + len(close_)
        start = text.find(open_, pos)
    parts.append(text[pos:])
    return "".join(parts)


def tagged(text: str, *tags: str) -> Iterator[tuple[str, str]]:
    """(tag, inner text) of the non-overlapping blocks of any of `tags`, left to right, each closed by the first
    matching close tag after it (what `re.finditer(r"<(a|b)>(.*?)</\\1>", text, re.DOTALL)` yields)."""
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
        inner = start + len(opens[k])
        close = text.find(closes[k], inner)
        if close < 0:  # this tag is finished (see the module docstring)
            nxt[k] = -1
            continue
        end = close + len(closes[k])
        yield tags[k], text[inner:close]
        for j, p in enumerate(nxt):
            if 0 <= p < end:
                nxt[j] = text.find(opens[j], end)
