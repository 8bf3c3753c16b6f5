"""The wiki-18-shaped corpus generator used for scale builds: shape, determinism, random access, CLI."""

from __future__ import annotations

import json
from collections import Counter

from rlf_envs.data.wiki.generate import WORDS_PER_PASSAGE, WikiGenerator, WikiShape, main
from rlf_envs.retrieval.corpus import iter_corpus

SMALL = WikiShape(vocab=5000)


def test_passages_have_wiki18_shape_and_zipf_like_frequencies() -> None:
    gen = WikiGenerator(SMALL)
    passages = gen.passages(0, 2500)
    assert [p["id"] for p in passages] == [str(i) for i in range(1, 2501)]
    titles = []
    counts: Counter[str] = Counter()
    for p in passages:
        title, text = p["contents"].split("\n")
        assert title.startswith('"') and title.endswith('"')
        words = text.rstrip(".").split(" ")
        assert len(words) == WORDS_PER_PASSAGE
        counts.update(w.lower() for w in words)
        titles.append(title)
    # articles span several consecutive passages that repeat the title
    assert 1.5 < len(titles) / len(set(titles)) < 6
    freq = [c for _, c in counts.most_common()]
    assert freq[0] > 20 * freq[len(freq) // 2]  # a heavy head and a long tail


def test_deterministic_and_random_access() -> None:
    a = WikiGenerator(SMALL).passages(0, 3100)
    b = WikiGenerator(SMALL).passages(1990, 3050)
    assert a[1990:3050] == b
    c = WikiGenerator(WikiShape(vocab=5000, seed=1)).passages(0, 10)
    assert c != a[:10]


def test_cli_writes_a_corpus_rlf_reads_and_queries(tmp_path) -> None:
    out = tmp_path / "wiki.jsonl"
    assert main(["--passages", "1234", "--out", str(out), "--queries", "7", "--vocab", "5000", "--quiet"]) == 0
    docs = list(iter_corpus(out))
    assert len(docs) == 1234 and docs[-1].id == "1234"
    queries = [json.loads(line) for line in out.with_suffix(".queries.jsonl").read_text().splitlines()]
    assert len(queries) == 7
    for q in queries:
        title = docs[int(q["passage_id"]) - 1].contents.split("\n")[0].strip('"').lower()
        assert q["question"].endswith(f"of {title}?")
    assert not (tmp_path / "wiki.jsonl.partial").exists()


def test_parallel_generation_writes_the_same_file(tmp_path) -> None:
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    common = ["--passages", "25000", "--vocab", "5000", "--quiet"]
    assert main([*common, "--out", str(one)]) == 0
    assert main([*common, "--out", str(two), "--workers", "2"]) == 0
    assert one.read_bytes() == two.read_bytes()
