"""Deterministic generator of rlf's offline search data set (invented-world QA).

    python -m rlf_envs.data.search.generate            # rewrite corpus.jsonl, train.jsonl, test.jsonl here
    python -m rlf_envs.data.search.generate --check    # also verify retrieval with the BM25 index
    python -m rlf_envs.data.search.generate --world quickstart --out DIR   # the larger quickstart world

Every entity (country, city, person, company, river) has an invented name and random attributes,
so no model can know a fact without searching. Documents are one or two regular sentences; every
answer is a single word. See README.md next to this file.

The `quickstart` world (not shipped: generated deterministically at first use into rlf's cache dir,
see `world_dir`) is built for training tiny policies on CPU: 9,200 invented people, each with one fact
(job, pet or color, from 20-word vocabularies) in one short document (`Name: job painter.`) and one
question; 9,000 train questions and 200 test questions about people who never appear in train.
Memorising train answers is useless on the test split; reading the retrieved document is what pays.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

SEED = 1729
N_COUNTRIES = 30
CITIES_PER_COUNTRY = 4
N_PEOPLE = 200
N_COMPANIES = 100
N_TWO_HOP = 300
TEST_SINGLE = 160
TEST_TWO_HOP = 40
JOBS = ("painter", "farmer", "sailor", "poet", "doctor", "baker", "singer", "teacher", "miner", "weaver")

ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "tr", "gr", "st")
VOWELS = ("a", "e", "i", "o", "u")
CODAS = ("", "", "n", "r", "l", "s", "k", "m")

HERE = Path(__file__).resolve().parent


@dataclass
class World:
    countries: list[str] = field(default_factory=list)
    capital: dict[str, str] = field(default_factory=dict)
    river: dict[str, str] = field(default_factory=dict)
    cities: list[str] = field(default_factory=list)
    city_country: dict[str, str] = field(default_factory=dict)
    city_year: dict[str, int] = field(default_factory=dict)
    mayor: dict[str, str] = field(default_factory=dict)
    people: list[str] = field(default_factory=list)
    job: dict[str, str] = field(default_factory=dict)
    birth_city: dict[str, str] = field(default_factory=dict)
    birth_year: dict[str, int] = field(default_factory=dict)
    companies: list[str] = field(default_factory=list)
    founder: dict[str, str] = field(default_factory=dict)
    company_city: dict[str, str] = field(default_factory=dict)
    company_year: dict[str, int] = field(default_factory=dict)
    doc_id: dict[str, str] = field(default_factory=dict)


class _Names:
    """Unique invented capitalised names."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: set[str] = set()

    def make(self, syllables: int, suffix: str = "") -> str:
        while True:
            parts = []
            for i in range(syllables):
                coda = self.rng.choice(CODAS) if i == syllables - 1 else ""
                parts.append(self.rng.choice(ONSETS) + self.rng.choice(VOWELS) + coda)
            name = ("".join(parts) + suffix).capitalize()
            if name not in self.used and 4 <= len(name) <= 11:
                self.used.add(name)
                return name


def make_world(seed: int = SEED) -> World:
    rng = random.Random(seed)
    names = _Names(rng)
    w = World()
    for _ in range(N_COUNTRIES):
        c = names.make(2, "ia")
        w.countries.append(c)
        w.river[c] = names.make(2, "a")
        for j in range(CITIES_PER_COUNTRY):
            city = names.make(rng.choice((2, 3)))
            w.cities.append(city)
            w.city_country[city] = c
            w.city_year[city] = rng.randint(900, 1800)
            if j == 0:
                w.capital[c] = city
    for _ in range(N_PEOPLE):
        p = names.make(2)
        w.people.append(p)
        w.job[p] = rng.choice(JOBS)
        w.birth_city[p] = rng.choice(w.cities)
        w.birth_year[p] = rng.randint(1700, 1990)
    for city, p in zip(w.cities, rng.sample(w.people, len(w.cities)), strict=True):
        w.mayor[city] = p
    for p in rng.sample(w.people, N_COMPANIES):
        k = names.make(2, "corp")
        w.companies.append(k)
        w.founder[k] = p
        w.company_city[k] = rng.choice(w.cities)
        w.company_year[k] = rng.randint(max(1800, w.birth_year[p] + 18), 2020)
    return w


def documents(w: World) -> list[dict[str, str]]:
    docs: list[tuple[str, str]] = []
    for c in w.countries:
        docs.append((c, f"{c} is a country. Its capital is {w.capital[c]} and its river is the {w.river[c]}."))
    for x in w.cities:
        docs.append(
            (x, f"{x} is a city in {w.city_country[x]} founded in {w.city_year[x]}. Its mayor is {w.mayor[x]}.")
        )
    for p in w.people:
        docs.append((p, f"{p} is a {w.job[p]} born in {w.birth_city[p]} in {w.birth_year[p]}."))
    for k in w.companies:
        text = f"{k} is a company founded by {w.founder[k]} in {w.company_year[k]}."
        docs.append((k, f"{text} It is based in {w.company_city[k]}."))
    out = []
    for i, (title, text) in enumerate(docs):
        w.doc_id[title] = str(i)
        out.append({"id": str(i), "contents": f'"{title}"\n{text}'})
    return out


def _q(question: str, answer: str | int, hops: int, relation: str, entities: list[str], w: World) -> dict[str, object]:
    return {
        "question": question,
        "answers": [str(answer)],
        "meta": {"hops": hops, "relation": relation, "entity": entities[0], "docs": [w.doc_id[e] for e in entities]},
    }


def questions(w: World, rng: random.Random) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    single: list[dict[str, object]] = []
    for c in w.countries:
        single.append(_q(f"What is the capital of {c}?", w.capital[c], 1, "capital", [c], w))
        single.append(_q(f"What is the river of {c}?", w.river[c], 1, "river", [c], w))
    for x in w.cities:
        single.append(_q(f"In which country is the city {x}?", w.city_country[x], 1, "country", [x], w))
        single.append(_q(f"Who is the mayor of {x}?", w.mayor[x], 1, "mayor", [x], w))
        single.append(_q(f"In which year was {x} founded?", w.city_year[x], 1, "city_year", [x], w))
    for p in w.people:
        single.append(_q(f"What is the job of {p}?", w.job[p], 1, "job", [p], w))
        single.append(_q(f"In which city was {p} born?", w.birth_city[p], 1, "birth_city", [p], w))
        single.append(_q(f"In which year was {p} born?", w.birth_year[p], 1, "birth_year", [p], w))
    for k in w.companies:
        single.append(_q(f"Who founded {k}?", w.founder[k], 1, "founder", [k], w))
        single.append(_q(f"In which city is {k} based?", w.company_city[k], 1, "company_city", [k], w))
        single.append(_q(f"In which year was {k} founded?", w.company_year[k], 1, "company_year", [k], w))
    two: list[dict[str, object]] = []
    for x in w.cities:
        c = w.city_country[x]
        if w.capital[c] != x:
            two.append(_q(f"What is the capital of the country of {x}?", w.capital[c], 2, "country.capital", [x, c], w))
    for c in w.countries:
        cap = w.capital[c]
        two.append(_q(f"Who is the mayor of the capital of {c}?", w.mayor[cap], 2, "capital.mayor", [c, cap], w))
    for k in w.companies:
        p = w.founder[k]
        two.append(
            _q(f"In which city was the founder of {k} born?", w.birth_city[p], 2, "founder.birth_city", [k, p], w)
        )
        two.append(
            _q(f"In which year was the founder of {k} born?", w.birth_year[p], 2, "founder.birth_year", [k, p], w)
        )
    for p in w.people:
        city = w.birth_city[p]
        two.append(_q(f"In which country was {p} born?", w.city_country[city], 2, "birth_city.country", [p, city], w))
    two = rng.sample(two, N_TWO_HOP)
    rng.shuffle(single)
    test = single[:TEST_SINGLE] + two[:TEST_TWO_HOP]
    train = single[TEST_SINGLE:] + two[TEST_TWO_HOP:]
    rng.shuffle(test)
    rng.shuffle(train)
    for prefix, rows in (("train", train), ("test", test)):
        for i, row in enumerate(rows):
            row["id"] = f"{prefix}-{i:05d}"
    return train, test


# -- the quickstart world ---------------------------------------------------------------------------

QUICKSTART_VERSION = 2
QUICKSTART_SEED = 4242
QUICKSTART_TRAIN_PEOPLE = 9000
QUICKSTART_TEST_PEOPLE = 200
QUICKSTART_RELATIONS: dict[str, tuple[str, ...]] = {
    "job": ("painter", "farmer", "sailor", "poet", "doctor", "baker", "singer", "teacher", "miner", "weaver",
            "hunter", "tailor", "potter", "smith", "judge", "nurse", "pilot", "dancer", "writer", "cook"),
    "pet": ("cat", "dog", "goat", "horse", "rabbit", "parrot", "mouse", "snake", "turtle", "pig",
            "duck", "lamb", "fox", "owl", "frog", "crow", "bee", "hen", "fish", "wolf"),
    "color": ("red", "blue", "green", "black", "white", "yellow", "orange", "purple", "brown", "pink",
              "gray", "silver", "gold", "violet", "amber", "teal", "cyan", "olive", "navy", "ivory"),
}


def quickstart_world(seed: int = QUICKSTART_SEED) -> tuple[list[dict[str, object]], list[dict[str, object]],
                                                            list[dict[str, object]]]:
    """(corpus, train, test) rows of the quickstart world: one person, one fact, one document, one question;
    the test people never appear in train questions."""
    rng = random.Random(seed)
    names = _Names(rng)
    n = QUICKSTART_TRAIN_PEOPLE + QUICKSTART_TEST_PEOPLE
    rels = list(QUICKSTART_RELATIONS)
    corpus: list[dict[str, object]] = []
    rows: list[dict[str, object]] = []
    for i in range(n):
        p = names.make(rng.choice((2, 2, 3)))
        rel = rels[i % len(rels)]
        value = rng.choice(QUICKSTART_RELATIONS[rel])
        corpus.append({"id": str(i), "contents": f'"{p}"\n{p}: {rel} {value}.'})
        rows.append({"question": f"What is the {rel} of {p}?", "answers": [value],
                     "meta": {"hops": 1, "relation": rel, "entity": p, "docs": [str(i)]}})
    train, test = rows[:QUICKSTART_TRAIN_PEOPLE], rows[QUICKSTART_TRAIN_PEOPLE:]
    rng.shuffle(train)
    rng.shuffle(test)
    for prefix, split in (("train", train), ("test", test)):
        for k, row in enumerate(split):
            row["id"] = f"{prefix}-{k:05d}"
    return corpus, train, test


def generate_quickstart(out_dir: Path, seed: int = QUICKSTART_SEED) -> dict[str, int]:
    """Write the quickstart world's corpus.jsonl, train.jsonl and test.jsonl into `out_dir`."""
    corpus, train, test = quickstart_world(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    _dump(corpus, out_dir / "corpus.jsonl", ("id", "contents"))
    _dump(train, out_dir / "train.jsonl", ("id", "question", "answers", "meta"))
    _dump(test, out_dir / "test.jsonl", ("id", "question", "answers", "meta"))
    return {"documents": len(corpus), "train": len(train), "test": len(test)}


WORLDS = ("default", "quickstart")


def world_dir(world: str = "default") -> Path:
    """The data directory of `world`: "default" is the shipped data here; "quickstart" is generated once
    (deterministic, ~2.5 MB) into rlf's cache dir (`$RLF_CACHE_DIR`, else ~/.cache/rlf)."""
    if world == "default":
        return HERE
    if world != "quickstart":
        raise ValueError(f"world must be one of {WORLDS}, got {world!r}")
    cache = Path(os.environ.get("RLF_CACHE_DIR") or Path.home() / ".cache" / "rlf")
    out = cache / f"search-world-quickstart-v{QUICKSTART_VERSION}-{QUICKSTART_SEED}"
    if not (out / "test.jsonl").is_file():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=cache))
        try:
            generate_quickstart(tmp)
            try:
                os.replace(tmp, out)  # atomic; fails if another process won the race (then its copy is used)
            except OSError:
                if not (out / "test.jsonl").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _dump(rows: Sequence[Mapping[str, object]], path: Path, key_order: tuple[str, ...]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({k: row[k] for k in key_order}, ensure_ascii=False) + "\n")


def generate(out_dir: Path = HERE, seed: int = SEED) -> dict[str, int]:
    """Write corpus.jsonl, train.jsonl and test.jsonl into `out_dir`; return the counts."""
    w = make_world(seed)
    docs = documents(w)
    train, test = questions(w, random.Random(seed + 1))
    out_dir.mkdir(parents=True, exist_ok=True)
    _dump(docs, out_dir / "corpus.jsonl", ("id", "contents"))
    _dump(train, out_dir / "train.jsonl", ("id", "question", "answers", "meta"))
    _dump(test, out_dir / "test.jsonl", ("id", "question", "answers", "meta"))
    return {"documents": len(docs), "train": len(train), "test": len(test)}


def check(out_dir: Path) -> dict[str, float]:
    """Retrieval sanity of the written files with rlf's BM25 index (needs the `search` extra)."""
    import tempfile

    from rlf_envs.retrieval import build_index, load_index

    docs = [json.loads(line) for line in (out_dir / "corpus.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for f in ("train.jsonl", "test.jsonl") for line in (out_dir / f).read_text().splitlines()]
    with tempfile.TemporaryDirectory() as tmp:
        build_index(out_dir / "corpus.jsonl", Path(tmp) / "idx", kind="bm25", show_progress=False)
        index = load_index(Path(tmp) / "idx")
        titles = [d["contents"].split("\n", 1)[0].strip('"') for d in docs]
        name_hits = index.search_batch(titles, 1)
        name_top1 = sum(h[0].document.id == d["id"] for h, d in zip(name_hits, docs, strict=True)) / len(docs)
        single = [r for r in rows if r["meta"]["hops"] == 1]
        q_hits = index.search_batch([r["question"] for r in single], 1)
        q_top1 = sum(h[0].document.id == r["meta"]["docs"][0] for h, r in zip(q_hits, single, strict=True))
        index.close()
    return {"entity_name_top1": name_top1, "single_hop_question_top1": q_top1 / len(single)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--check", action="store_true", help="verify that BM25 finds each entity's document")
    ap.add_argument("--world", choices=WORLDS, default="default")
    args = ap.parse_args(argv)
    if args.world == "quickstart":
        seed = QUICKSTART_SEED if args.seed == SEED else args.seed
        print(json.dumps(generate_quickstart(args.out, seed)))
    else:
        print(json.dumps(generate(args.out, args.seed)))
    if args.check:
        stats = check(args.out)
        print(json.dumps(stats))
        if stats["entity_name_top1"] < 1.0:
            print("error: some entity name does not retrieve its own document first", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
