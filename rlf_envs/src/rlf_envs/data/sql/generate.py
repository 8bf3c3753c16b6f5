"""Deterministic generator of rlf's offline text-to-SQL data (three small invented databases).

    python -m rlf_envs.data.sql.generate          # rewrite databases/*.sql, train.json, test.json here

The layout is Spider's, so the same loader reads this data and the real benchmarks: `train.json` /
`test.json` are JSON arrays of `{"db_id", "question", "query"}`, and each database is a SQL dump
`databases/<db_id>.sql` that `rlf_envs.data.sql.database_dir()` turns into
`<cache>/database/<db_id>/<db_id>.sqlite` once (Spider ships the `.sqlite` files themselves).

Databases: `shop` (customers, products, orders), `school` (students, courses, enrollments),
`library` (authors, books, loans); invented names and random values. Questions come from templates
(some ordered: their gold query has ORDER BY, so the verifier compares rows in order), each filled
with every value of its parameter; one in five filled questions (per template, seeded) goes to the
test split, so no test question is ever asked in train (the generator asserts it). What a test
question shares with train is its template: the skill is reading the value out of the question and
writing it into the right query shape. `sft_demos.jsonl`: scripted warm-start demonstrations
(`build_demos`).
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 4242
TEST_SHARE = 0.2

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "", "n", "r", "l", "s", "k")


def _name(rng: random.Random, used: set[str], syllables: int = 2) -> str:
    while True:
        w = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        w = w.capitalize()
        if w not in used:
            used.add(w)
            return w


CITIES = ("Oslo", "Lima", "Cairo", "Perth", "Quito", "Riga", "Seoul", "Turin", "Dakar", "Hanoi", "Bern", "Kyiv")
CATEGORIES = ("tools", "toys", "books", "garden", "kitchen", "sports", "music", "office", "games", "bikes")
HOUSES = ("red", "blue", "green", "gold", "black", "white")
DEPARTMENTS = ("math", "physics", "history", "art", "biology", "music", "chemistry", "drama")
COUNTRIES = ("Norway", "Peru", "Egypt", "Chile", "Ghana", "Japan", "Spain", "Kenya", "Nepal", "Cuba")
GENRES = ("mystery", "poetry", "fantasy", "history", "science", "travel", "drama", "romance")


@dataclass(frozen=True)
class Template:
    """One question shape: `question` and `query` are str.format patterns over one parameter `v`."""

    db_id: str
    question: str
    query: str
    values: Callable[[dict[str, list[str]]], list[str]]


def _build_shop(conn: sqlite3.Connection, rng: random.Random) -> dict[str, list[str]]:
    used: set[str] = set()
    conn.executescript(
        "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);"
        "CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, price REAL);"
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers(id),"
        " product_id INTEGER REFERENCES products(id), quantity INTEGER, year INTEGER);"
    )
    customers = [(i, _name(rng, used) + " " + _name(rng, used), rng.choice(CITIES)) for i in range(1, 61)]
    products = [(i, _name(rng, used, 3), rng.choice(CATEGORIES), round(rng.uniform(2, 300), 2)) for i in range(1, 81)]
    orders = [(i, rng.randint(1, 60), rng.randint(1, 80), rng.randint(1, 9), rng.randint(2015, 2024))
              for i in range(1, 401)]
    conn.executemany("INSERT INTO customers VALUES (?, ?, ?)", customers)
    conn.executemany("INSERT INTO products VALUES (?, ?, ?, ?)", products)
    conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?, ?)", orders)
    return {"city": sorted({c[2] for c in customers}), "category": sorted({p[2] for p in products}),
            "year": [str(y) for y in range(2015, 2025)], "customer": sorted(c[1] for c in customers)}


def _build_school(conn: sqlite3.Connection, rng: random.Random) -> dict[str, list[str]]:
    used: set[str] = set()
    conn.executescript(
        "CREATE TABLE students (id INTEGER PRIMARY KEY, name TEXT NOT NULL, grade INTEGER, house TEXT);"
        "CREATE TABLE courses (id INTEGER PRIMARY KEY, title TEXT NOT NULL, department TEXT NOT NULL);"
        "CREATE TABLE enrollments (student_id INTEGER REFERENCES students(id),"
        " course_id INTEGER REFERENCES courses(id), score INTEGER);"
    )
    students = [(i, _name(rng, used), rng.randint(7, 12), rng.choice(HOUSES)) for i in range(1, 101)]
    courses = [(i, _name(rng, used, 3), rng.choice(DEPARTMENTS)) for i in range(1, 31)]
    pairs = sorted({(rng.randint(1, 100), rng.randint(1, 30)) for _ in range(500)})
    conn.executemany("INSERT INTO students VALUES (?, ?, ?, ?)", students)
    conn.executemany("INSERT INTO courses VALUES (?, ?, ?)", courses)
    conn.executemany("INSERT INTO enrollments VALUES (?, ?, ?)", [(s, c, rng.randint(40, 100)) for s, c in pairs])
    return {"house": sorted({s[3] for s in students}), "grade": [str(g) for g in range(7, 13)],
            "department": sorted({c[2] for c in courses}), "student": sorted(s[1] for s in students),
            "course": sorted(c[1] for c in courses)}


def _build_library(conn: sqlite3.Connection, rng: random.Random) -> dict[str, list[str]]:
    used: set[str] = set()
    conn.executescript(
        "CREATE TABLE authors (id INTEGER PRIMARY KEY, name TEXT NOT NULL, country TEXT);"
        "CREATE TABLE books (id INTEGER PRIMARY KEY, title TEXT NOT NULL, author_id INTEGER REFERENCES authors(id),"
        " genre TEXT, year INTEGER, pages INTEGER);"
        "CREATE TABLE loans (id INTEGER PRIMARY KEY, book_id INTEGER REFERENCES books(id), member TEXT, days INTEGER);"
    )
    authors = [(i, _name(rng, used) + " " + _name(rng, used), rng.choice(COUNTRIES)) for i in range(1, 41)]
    books = [(i, "The " + _name(rng, used, 3), rng.randint(1, 40), rng.choice(GENRES), rng.randint(1950, 2023),
              rng.randint(80, 900)) for i in range(1, 151)]
    members = [_name(rng, used) for _ in range(30)]
    loans = [(i, rng.randint(1, 150), rng.choice(members), rng.randint(1, 60)) for i in range(1, 301)]
    conn.executemany("INSERT INTO authors VALUES (?, ?, ?)", authors)
    conn.executemany("INSERT INTO books VALUES (?, ?, ?, ?, ?, ?)", books)
    conn.executemany("INSERT INTO loans VALUES (?, ?, ?, ?)", loans)
    return {"country": sorted({a[2] for a in authors}), "genre": sorted({b[3] for b in books}),
            "author": sorted(a[1] for a in authors), "member": sorted(set(members)),
            "decade": [str(d) for d in range(1950, 2030, 10)]}


BUILDERS = {"shop": _build_shop, "school": _build_school, "library": _build_library}


def _v(key: str, n: int | None = None) -> Callable[[dict[str, list[str]]], list[str]]:
    return lambda values: values[key][:n] if n else values[key]


TEMPLATES = (
    # shop
    Template("shop", "How many customers live in {v}?", "SELECT COUNT(*) FROM customers WHERE city = '{v}'",
             _v("city")),
    Template("shop", "List the names of customers who live in {v}.",
             "SELECT name FROM customers WHERE city = '{v}'", _v("city")),
    Template("shop", "How many products are in the {v} category?",
             "SELECT COUNT(*) FROM products WHERE category = '{v}'", _v("category")),
    Template("shop", "What is the average price of {v} products?",
             "SELECT AVG(price) FROM products WHERE category = '{v}'", _v("category")),
    Template("shop", "List the {v} products from the cheapest to the most expensive.",
             "SELECT name FROM products WHERE category = '{v}' ORDER BY price, name", _v("category")),
    Template("shop", "How many orders were placed in {v}?", "SELECT COUNT(*) FROM orders WHERE year = {v}",
             _v("year")),
    Template("shop", "What is the total quantity ordered in {v}?",
             "SELECT SUM(quantity) FROM orders WHERE year = {v}", _v("year")),
    Template("shop", "How many orders did {v} place?",
             "SELECT COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id "
             "WHERE customers.name = '{v}'", _v("customer", 40)),
    Template("shop", "Which products did {v} order?",
             "SELECT DISTINCT products.name FROM orders JOIN customers ON orders.customer_id = customers.id "
             "JOIN products ON orders.product_id = products.id WHERE customers.name = '{v}'", _v("customer", 40)),
    # school
    Template("school", "How many students are in the {v} house?",
             "SELECT COUNT(*) FROM students WHERE house = '{v}'", _v("house")),
    Template("school", "List the names of students in grade {v} in alphabetical order.",
             "SELECT name FROM students WHERE grade = {v} ORDER BY name", _v("grade")),
    Template("school", "How many courses does the {v} department offer?",
             "SELECT COUNT(*) FROM courses WHERE department = '{v}'", _v("department")),
    Template("school", "List the titles of {v} courses.", "SELECT title FROM courses WHERE department = '{v}'",
             _v("department")),
    Template("school", "What is the average score in the {v} department?",
             "SELECT AVG(enrollments.score) FROM enrollments JOIN courses ON enrollments.course_id = courses.id "
             "WHERE courses.department = '{v}'", _v("department")),
    Template("school", "How many courses is {v} enrolled in?",
             "SELECT COUNT(*) FROM enrollments JOIN students ON enrollments.student_id = students.id "
             "WHERE students.name = '{v}'", _v("student", 50)),
    Template("school", "What is the highest score of {v}?",
             "SELECT MAX(enrollments.score) FROM enrollments JOIN students ON enrollments.student_id = students.id "
             "WHERE students.name = '{v}'", _v("student", 50)),
    Template("school", "How many students take {v}?",
             "SELECT COUNT(*) FROM enrollments JOIN courses ON enrollments.course_id = courses.id "
             "WHERE courses.title = '{v}'", _v("course")),
    # library
    Template("library", "How many authors come from {v}?",
             "SELECT COUNT(*) FROM authors WHERE country = '{v}'", _v("country")),
    Template("library", "List the names of authors from {v}.", "SELECT name FROM authors WHERE country = '{v}'",
             _v("country")),
    Template("library", "How many {v} books are there?", "SELECT COUNT(*) FROM books WHERE genre = '{v}'",
             _v("genre")),
    Template("library", "List the titles of {v} books from the oldest to the newest.",
             "SELECT title FROM books WHERE genre = '{v}' ORDER BY year, title", _v("genre")),
    Template("library", "How many books did {v} write?",
             "SELECT COUNT(*) FROM books JOIN authors ON books.author_id = authors.id WHERE authors.name = '{v}'",
             _v("author")),
    Template("library", "List the titles of books by {v}.",
             "SELECT books.title FROM books JOIN authors ON books.author_id = authors.id WHERE authors.name = '{v}'",
             _v("author")),
    Template("library", "How many loans did {v} make?", "SELECT COUNT(*) FROM loans WHERE member = '{v}'",
             _v("member")),
    Template("library", "How many books were published in the {v}s?",
             "SELECT COUNT(*) FROM books WHERE year >= {v} AND year < {v} + 10", _v("decade")),
)


def build_databases() -> tuple[dict[str, str], dict[str, dict[str, list[str]]]]:
    """Each database as a SQL dump, and the values its templates are filled with."""
    dumps: dict[str, str] = {}
    values: dict[str, dict[str, list[str]]] = {}
    for i, (db_id, build) in enumerate(BUILDERS.items()):
        conn = sqlite3.connect(":memory:")
        try:
            with conn:
                values[db_id] = build(conn, random.Random(SEED + i))
            dumps[db_id] = "\n".join(conn.iterdump()) + "\n"
        finally:
            conn.close()
    return dumps, values


def build_splits(values: dict[str, dict[str, list[str]]]) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Spider-style records of every template filled with every value, split per template (seeded)."""
    rng = random.Random(SEED)
    train: list[dict[str, str]] = []
    test: list[dict[str, str]] = []
    for t in TEMPLATES:
        recs = [{"db_id": t.db_id, "question": t.question.format(v=v), "query": t.query.format(v=v)}
                for v in t.values(values[t.db_id])]
        rng.shuffle(recs)
        n_test = max(1, round(len(recs) * TEST_SHARE))
        test.extend(recs[:n_test])
        train.extend(recs[n_test:])
    overlap = {r["question"] for r in train} & {r["question"] for r in test}
    assert not overlap, f"test questions asked in train: {sorted(overlap)[:3]}"
    return train, test


DEMOS_PER_TASK = 3
P_GUESS = 0.6


def _call(sql: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "run_query", "arguments": {"sql": sql}}) + "\n</tool_call><|im_end|>"


def build_demos(train: list[dict[str, str]]) -> list[dict[str, object]]:
    """Scripted, deliberately imperfect SFT demonstrations on the train split (qwen3 tool calls), for
    `sft.demos_path` of configs/sql_quickstart.yaml. With probability P_GUESS a demo answers at once with
    the query of another question of the same template (a plausible guess: right shape, wrong value);
    otherwise it runs the gold query, reads the rows, and answers it. Imitation alone therefore stays
    well below what always writing the asked-for query reaches."""
    rng = random.Random(SEED + 1)
    shape = {r["query"]: next(t for t in TEMPLATES if t.db_id == r["db_id"] and _fits(t, r)) for r in train}
    same: dict[Template, list[str]] = {}
    for r in train:
        same.setdefault(shape[r["query"]], []).append(r["query"])
    demos: list[dict[str, object]] = []
    for i, r in enumerate(train):
        for _ in range(DEMOS_PER_TASK):
            others = [q for q in same[shape[r["query"]]] if q != r["query"]]
            if others and rng.random() < P_GUESS:
                actions = [f"<answer>{rng.choice(others)}</answer><|im_end|>"]
            else:
                actions = [_call(r["query"]), f"<answer>{r['query']}</answer><|im_end|>"]
            demos.append({"task_index": i, "actions": actions})
    return demos


def _fits(t: Template, rec: dict[str, str]) -> bool:
    head, _, tail = t.question.partition("{v}")
    q = rec["question"]
    if not (q.startswith(head) and q.endswith(tail) and len(q) > len(head) + len(tail)):
        return False
    return t.query.format(v=q[len(head):len(q) - len(tail)]) == rec["query"]


def write(out: Path = HERE) -> None:
    dumps, values = build_databases()
    train, test = build_splits(values)
    with (out / "sft_demos.jsonl").open("w", encoding="utf-8") as f:
        for d in build_demos(train):
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    (out / "databases").mkdir(parents=True, exist_ok=True)
    for db_id, sql in dumps.items():
        (out / "databases" / f"{db_id}.sql").write_text(sql, encoding="utf-8")
    for name, recs in (("train", train), ("test", test)):
        (out / f"{name}.json").write_text(json.dumps(recs, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(dumps)} databases, {len(train)} train and {len(test)} test questions to {out}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE)
    write(ap.parse_args(argv).out)


if __name__ == "__main__":
    main()
