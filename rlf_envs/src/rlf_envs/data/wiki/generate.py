"""A deterministic, streaming generator of wiki-18-shaped passages, for building and serving indexes at scale.

    python -m rlf_envs.data.wiki.generate --passages 1000000 --out wiki-1m.jsonl --queries 2000

Search-R1's corpus is wiki-18 (DPR's Wikipedia dump: 21,015,324 passages of 100 words, one JSON object
per line, `{"id": "1", "contents": "\\"Title\\"\\nText ..."}`, about 13 GiB). No such corpus may be
downloaded here, so this writes one of the same shape: articles with a 1-4 word title, split into
consecutive 100-word passages that all repeat the title (as DPR's split does), words drawn from a
Zipf-distributed vocabulary (exponent 1.07, `--vocab` distinct words, a long tail of rare ones) mixed
with each article's own topic words, so term statistics (document frequencies, posting-list lengths,
rare-word queries) resemble real text. Passages and queries depend only on `--seed` and the passage
index, and the corpus streams in chunks with memory bounded by `--chunk`, so a 21M-passage file can be
written on a laptop.

Queries (`--queries N --queries-out q.jsonl`): `{"id", "question", "passage_id"}`, each naming an
article's title words and a few of one passage's topic words, like an entity question. `passage_id`
is the passage the query was made from (a sanity check, not a gold label: several passages share topics).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WORDS_PER_PASSAGE = 100
_CHUNK = 1000  # passages drawn together (random access costs at most one chunk)
WIKI18_PASSAGES = 21_015_324
_CONSONANTS = [*"bcdfghjklmnprstvwz", "ch", "sh", "th", "st", "br", "tr", "gr", "pl"]
_VOWELS = [*"aeiou", "ai", "ou", "ea", "io"]


@dataclass(frozen=True)
class WikiShape:
    """The knobs of the generated corpus (defaults chosen to resemble wiki-18's statistics)."""

    vocab: int = 300_000
    zipf_exponent: float = 1.07
    topic_words: int = 24  # words of an article's own (drawn from the mid/rare part of the vocabulary)
    topic_share: float = 0.3  # share of a passage's words taken from its article's topic words
    mean_passages_per_article: float = 3.0
    seed: int = 0


def _vocabulary(n: int, seed: int) -> np.ndarray:
    """`n` distinct pronounceable words (1-4 syllables), deterministic in `seed`."""
    rng = np.random.default_rng([seed, 1])
    cons = np.array(_CONSONANTS)
    vows = np.array(_VOWELS)
    words: list[str] = []
    seen: set[str] = set()
    while len(words) < n:
        m = n - len(words)
        sylls = rng.integers(1, 5, size=m)
        c = cons[rng.integers(0, len(cons), size=(m, 5))]
        v = vows[rng.integers(0, len(vows), size=(m, 5))]
        for i in range(m):
            w = "".join(c[i, j] + v[i, j] for j in range(sylls[i]))
            if w not in seen:
                seen.add(w)
                words.append(w)
    # frequent words should be short, as in real text: rank by length (stable), then Zipf over ranks
    words.sort(key=len)
    return np.array(words, dtype=object)


class WikiGenerator:
    """Passages and queries of one generated corpus; `passages(start, stop)` is random access by index."""

    def __init__(self, shape: WikiShape | None = None) -> None:
        self.shape = s = shape or WikiShape()
        self.vocab = _vocabulary(s.vocab, s.seed)
        ranks = np.arange(1, s.vocab + 1, dtype=np.float64)
        weights = ranks**-s.zipf_exponent
        self._cdf = np.cumsum(weights / weights.sum())
        self._cdf[-1] = 1.0

    # article structure: article a covers passages [starts[a], starts[a+1]); sizes are 1 + geometric
    def _article_of(self, first: int, last: int) -> tuple[np.ndarray, np.ndarray]:
        """(article index, article's first passage) of every passage in [first, last)."""
        # blocks of 4,096 passages are cut into articles independently, so any range is cheap to locate
        block = 4096
        arts, starts = [], []
        for b in range(first // block, (last - 1) // block + 1):
            rng = np.random.default_rng([self.shape.seed, 2, b])
            sizes = 1 + rng.geometric(1 / self.shape.mean_passages_per_article, size=block)
            bounds = np.minimum(np.concatenate([[0], np.cumsum(sizes)]), block)
            bounds = np.unique(bounds)
            local = np.searchsorted(bounds, np.arange(block), side="right") - 1
            arts.append(b * block * 2 + local)  # a unique article id per (block, local article)
            starts.append(b * block + bounds[local])
        base = (first // block) * block
        art = np.concatenate(arts)[first - base : last - base]
        start = np.concatenate(starts)[first - base : last - base]
        return art, start

    def _article_words(self, article: int) -> tuple[str, np.ndarray]:
        rng = np.random.default_rng([self.shape.seed, 3, int(article)])
        n = self.shape.vocab
        title_ids = rng.integers(n // 50, n, size=int(rng.integers(1, 5)))
        title = " ".join(w.capitalize() for w in self.vocab[title_ids])
        topic = rng.integers(n // 100, n, size=self.shape.topic_words)
        return title, topic

    def _chunk(self, c: int) -> list[dict[str, str]]:
        """Passages [c * CHUNK, (c + 1) * CHUNK), drawn with one generator per chunk (vectorised)."""
        s = self.shape
        first = c * _CHUNK
        art, _ = self._article_of(first, first + _CHUNK)
        rng = np.random.default_rng([s.seed, 4, c])
        ids = np.searchsorted(self._cdf, rng.random((_CHUNK, WORDS_PER_PASSAGE)))
        from_topic = rng.random((_CHUNK, WORDS_PER_PASSAGE)) < s.topic_share
        pick = rng.integers(0, s.topic_words, size=(_CHUNK, WORDS_PER_PASSAGE))
        out: list[dict[str, str]] = []
        cache: dict[int, tuple[str, np.ndarray]] = {}
        for j in range(_CHUNK):
            a = int(art[j])
            if a not in cache:
                cache = {a: self._article_words(a)}
            title, topic = cache[a]
            row = np.where(from_topic[j], topic[pick[j]], ids[j])
            words = self.vocab[row].tolist()
            words[0] = words[0].capitalize()
            out.append({"id": str(first + j + 1), "contents": f'"{title}"\n' + " ".join(words) + "."})
        return out

    def passages(self, start: int, stop: int) -> list[dict[str, str]]:
        """Passages [start, stop) as wiki-18 JSON objects (ids are 1-based strings, as in wiki-18)."""
        out: list[dict[str, str]] = []
        for c in range(start // _CHUNK, (stop - 1) // _CHUNK + 1 if stop > start else start // _CHUNK):
            chunk = self._chunk(c)
            lo, hi = max(start - c * _CHUNK, 0), min(stop - c * _CHUNK, _CHUNK)
            out.extend(chunk[lo:hi])
        return out

    def queries(self, count: int, passages: int) -> list[dict[str, str]]:
        """`count` entity-style questions about random passages among the first `passages`."""
        rng = np.random.default_rng([self.shape.seed, 5])
        picks = np.sort(rng.choice(passages, size=min(count, passages), replace=False))
        out = []
        for qi, p in enumerate(picks):
            p = int(p)
            a = int(self._article_of(p, p + 1)[0][0])
            title, topic = self._article_words(a)
            qrng = np.random.default_rng([self.shape.seed, 6, p])
            extra = self.vocab[topic[qrng.choice(len(topic), size=int(qrng.integers(1, 4)), replace=False)]]
            question = f"what is the {' '.join(extra.tolist())} of {title.lower()}?"
            out.append({"id": f"q{qi}", "question": question, "passage_id": str(p + 1)})
        return out


_WORKER: WikiGenerator | None = None


def _init_worker(shape: WikiShape) -> None:
    global _WORKER
    _WORKER = WikiGenerator(shape)


def _render(span: tuple[int, int]) -> tuple[int, str]:
    assert _WORKER is not None
    batch = _WORKER.passages(*span)
    return len(batch), "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in batch)


def write_corpus(
    path: Path, count: int, shape: WikiShape | None = None, show_progress: bool = True, workers: int = 1
) -> float:
    """Write `count` passages to `path` (JSONL, atomically via a .partial file) with `workers` processes
    (the output does not depend on it); returns seconds taken."""
    shape = shape or WikiShape()
    tmp = path.with_name(path.name + ".partial")
    spans = [(start, min(count, start + 10_000)) for start in range(0, count, 10_000)]
    t0 = time.perf_counter()
    done = 0
    pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (shape,)) if workers > 1 else None
    try:
        if pool is None:
            _init_worker(shape)
        chunks = pool.imap(_render, spans) if pool is not None else map(_render, spans)
        with tmp.open("w", encoding="utf-8") as f:
            for n, text in chunks:
                f.write(text)
                done += n
                if show_progress:
                    rate = done / max(time.perf_counter() - t0, 1e-9)
                    print(
                        f"\rgenerated {done:,}/{count:,} passages ({rate:,.0f}/s)", end="", file=sys.stderr, flush=True
                    )
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    if show_progress:
        print(file=sys.stderr)
    tmp.replace(path)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passages", type=int, default=1_000_000, help="number of passages (wiki-18 has 21,015,324)")
    p.add_argument("--out", type=Path, required=True, help="the corpus JSONL to write")
    p.add_argument("--queries", type=int, default=0, help="also write this many queries")
    p.add_argument("--queries-out", type=Path, help="where the queries go (default: OUT with .queries.jsonl)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=WikiShape.vocab)
    p.add_argument("--workers", type=int, default=1, help="processes generating in parallel (same output)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.passages < 1:
        p.error("--passages must be >= 1")
    shape = WikiShape(vocab=a.vocab, seed=a.seed)
    seconds = write_corpus(a.out, a.passages, shape, show_progress=not a.quiet, workers=max(1, a.workers))
    size = a.out.stat().st_size
    print(f"wrote {a.passages:,} passages to {a.out} ({size / 2**20:,.1f} MiB) in {seconds:.1f}s", file=sys.stderr)
    if a.queries:
        qpath = a.queries_out or a.out.with_suffix(".queries.jsonl")
        qs = WikiGenerator(shape).queries(a.queries, a.passages)
        qpath.write_text("".join(json.dumps(q) + "\n" for q in qs), encoding="utf-8")
        print(f"wrote {len(qs):,} queries to {qpath}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
