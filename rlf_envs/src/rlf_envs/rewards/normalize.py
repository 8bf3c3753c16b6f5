"""Answer normalisation and string metrics, following Search-R1 / SQuAD conventions."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def normalize_answer(text: str) -> str:
    """Search-R1's normalisation: lower-case, drop ASCII punctuation, drop articles, collapse spaces.

    The order matters and matches Search-R1 exactly: punctuation is removed *before* articles,
    so "U.S." becomes "us" and "the-end" becomes "theend" (no article left to drop).
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: Iterable[str]) -> bool:
    """True if the normalised prediction equals any normalised gold answer."""
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(g) for g in golds)


def substring_match(prediction: str, golds: Iterable[str]) -> bool:
    """Search-R1's `subem_check`: some normalised gold answer occurs inside the normalised prediction."""
    pred = normalize_answer(prediction)
    return any(normalize_answer(g) in pred for g in golds)


def token_f1(prediction: str, gold: str) -> tuple[float, float, float]:
    """SQuAD-style token F1 on normalised text. Returns (f1, precision, recall)."""
    pred_toks = normalize_answer(prediction).split()
    gold_toks = normalize_answer(gold).split()
    if not pred_toks or not gold_toks:
        same = float(pred_toks == gold_toks)
        return same, same, same
    common = Counter(pred_toks) & Counter(gold_toks)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0, 0.0, 0.0
    precision = overlap / len(pred_toks)
    recall = overlap / len(gold_toks)
    return 2 * precision * recall / (precision + recall), precision, recall


def max_token_f1(prediction: str, golds: Iterable[str]) -> tuple[float, float, float]:
    """The best (f1, precision, recall) over all gold answers (by F1)."""
    best = (0.0, 0.0, 0.0)
    for g in golds:
        cur = token_f1(prediction, g)
        if cur[0] > best[0]:
            best = cur
    return best


def parse_number(text: str, *, last: bool = True) -> float | None:
    """Parse a number from text: the whole string if it is one, else the last (or first) number in it.

    Accepts thousands separators ("1,234"), a trailing percent sign, and simple fractions ("3/4").
    Returns None when no finite number is found.
    """
    s = text.strip().replace("$", "").rstrip("%").strip()
    frac = re.fullmatch(r"([-+]?\d+)\s*/\s*(\d+)", s)
    if frac:
        den = int(frac.group(2))
        return int(frac.group(1)) / den if den else None
    try:
        v = float(s.replace(",", ""))
        return v if math.isfinite(v) else None
    except ValueError:
        pass
    found = _NUMBER.findall(text)
    if not found:
        return None
    raw = (found[-1] if last else found[0]).replace(",", "")
    try:
        v = float(raw)
    except ValueError:
        return None
    return v if math.isfinite(v) else None
