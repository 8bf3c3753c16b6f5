"""Generate rlf/Code-v0's offline task set: math and data questions whose answers need computation.

`python -m rlf_envs.data.code.generate` rewrites `train.jsonl`, `test.jsonl` and `sft_demos.jsonl` next to
this file, deterministically. Each task carries how it is checked (`meta.check`: "numeric", "exact" or
"tests"), a reference program (`meta.program`, never shown to the policy; its output is the answer) and,
for data questions, the files put in the episode's work dir (`meta.files`). Test questions are never asked
in train (the split is by question text).
"""

from __future__ import annotations

import json
import math
import random
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUT_DIR = Path(__file__).resolve().parent
SEED = 13
N_TRAIN, N_TEST = 320, 80
REGIONS = ("north", "south", "east", "west")
PRODUCTS = ("apples", "pears", "plums", "figs", "kiwis")

Task = dict[str, Any]


def _primes_upto(n: int) -> list[int]:
    sieve = bytearray([1]) * (n + 1)
    sieve[:2] = b"\x00\x00"
    for i in range(2, math.isqrt(n) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))
    return [i for i, p in enumerate(sieve) if p]


def _task(question: str, answer: Any, program: str, check: str = "numeric", **meta: Any) -> Task:
    return {"question": question, "ground_truth": answer,
            "meta": {"check": check, "program": textwrap.dedent(program).strip() + "\n", **meta}}


def sum_primes(r: random.Random) -> Task:
    n = r.randrange(2_000, 60_000)
    return _task(f"What is the sum of all primes below {n}?", sum(_primes_upto(n - 1)), f"""
        n = {n}
        s = [True] * n
        s[0] = s[1] = False
        for i in range(2, int(n ** 0.5) + 1):
            if s[i]:
                s[i * i::i] = [False] * len(s[i * i::i])
        print(sum(i for i in range(n) if s[i]))""")


def count_primes(r: random.Random) -> Task:
    a = r.randrange(1_000, 40_000)
    b = a + r.randrange(500, 20_000)
    ans = sum(1 for p in _primes_upto(b) if p >= a)
    return _task(f"How many primes are there between {a} and {b} inclusive?", ans, f"""
        def is_prime(k):
            if k < 2:
                return False
            i = 2
            while i * i <= k:
                if k % i == 0:
                    return False
                i += 1
            return True
        print(sum(is_prime(k) for k in range({a}, {b} + 1)))""")


def divisors(r: random.Random) -> Task:
    n = r.randrange(2, 200) * r.randrange(2, 200) * r.randrange(2, 60)
    ans = sum(2 - (d * d == n) for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return _task(f"How many positive divisors does {n} have?", ans, f"""
        n = {n}
        print(sum(1 for d in range(1, n + 1) if n % d == 0))""")


def fib_mod(r: random.Random) -> Task:
    k, m = r.randrange(100, 5_000), r.choice((97, 1_000, 10_007, 65_536, 1_000_007))
    a, b = 0, 1
    for _ in range(k):
        a, b = b, a + b
    return _task(f"With F(1) = F(2) = 1, what is the {k}-th Fibonacci number F({k}) modulo {m}?", a % m, f"""
        a, b = 0, 1
        for _ in range({k}):
            a, b = b, a + b
        print(a % {m})""")


def multiples(r: random.Random) -> Task:
    n, a, b = r.randrange(1_000, 10**6), r.randrange(3, 30), r.randrange(3, 30)
    ans = n // a + n // b - n // math.lcm(a, b)
    return _task(f"How many integers from 1 to {n} are divisible by {a} or by {b}?", ans, f"""
        print(sum(1 for k in range(1, {n} + 1) if k % {a} == 0 or k % {b} == 0))""")


def powmod(r: random.Random) -> Task:
    a, b, m = r.randrange(2, 1_000), r.randrange(10**5, 10**9), r.randrange(1_000, 10**6)
    return _task(f"What is {a} to the power {b}, modulo {m}?", pow(a, b, m), f"print(pow({a}, {b}, {m}))")


def digit_sum(r: random.Random) -> Task:
    a, b = r.randrange(2, 20), r.randrange(50, 600)
    return _task(f"What is the sum of the decimal digits of {a}^{b}?", sum(map(int, str(a**b))),
                 f"print(sum(int(c) for c in str({a} ** {b})))")


def lcm3(r: random.Random) -> Task:
    xs = [r.randrange(10, 2_000) for _ in range(3)]
    return _task(f"What is the least common multiple of {xs[0]}, {xs[1]} and {xs[2]}?", math.lcm(*xs), f"""
        import math
        print(math.lcm({xs[0]}, {xs[1]}, {xs[2]}))""")


def _sales(r: random.Random) -> tuple[str, list[tuple[str, str, int, int]]]:
    rows = [(r.choice(REGIONS), r.choice(PRODUCTS), r.randrange(1, 90), r.randrange(2, 40))
            for _ in range(r.randrange(30, 50))]
    text = "region,product,units,price\n" + "".join(f"{a},{b},{c},{d}\n" for a, b, c, d in rows)
    return text, rows


_READ = """
        import csv
        rows = list(csv.DictReader(open("sales.csv")))"""


def revenue(r: random.Random) -> Task:
    text, rows = _sales(r)
    region = r.choice(REGIONS)
    ans = sum(u * p for g, _, u, p in rows if g == region)
    return _task(f"The file sales.csv (columns region,product,units,price; {len(rows)} rows) is in your working "
                 f"directory. What is the total revenue (units times price) of region {region}?", ans, _READ + f"""
        print(sum(int(x["units"]) * int(x["price"]) for x in rows if x["region"] == "{region}"))""",
                 files={"sales.csv": text})


def count_rows(r: random.Random) -> Task:
    text, rows = _sales(r)
    product, k = r.choice(PRODUCTS), r.randrange(10, 70)
    ans = sum(1 for _, p, u, _ in rows if p == product and u > k)
    return _task(f"The file sales.csv (columns region,product,units,price; {len(rows)} rows) is in your working "
                 f"directory. How many rows sell {product} with more than {k} units?", ans, _READ + f"""
        print(sum(1 for x in rows if x["product"] == "{product}" and int(x["units"]) > {k}))""",
                 files={"sales.csv": text})


def top_product(r: random.Random) -> Task:
    while True:
        text, rows = _sales(r)
        region = r.choice(REGIONS)
        totals = {p: sum(u for g, q, u, _ in rows if g == region and q == p) for p in PRODUCTS}
        ranked = sorted(totals.values(), reverse=True)
        if ranked[0] != ranked[1]:
            break
    ans = max(totals, key=lambda p: totals[p])
    return _task(f"The file sales.csv (columns region,product,units,price; {len(rows)} rows) is in your working "
                 f"directory. Which product sold the most units in region {region}? Answer with its name.", ans,
                 _READ + f"""
        totals = {{}}
        for x in rows:
            if x["region"] == "{region}":
                totals[x["product"]] = totals.get(x["product"], 0) + int(x["units"])
        print(max(totals, key=totals.get))""", check="exact", files={"sales.csv": text})


def write_function(r: random.Random) -> Task:
    a, b = r.randrange(2, 15), r.randrange(2, 15)
    ns = [r.randrange(1, 5_000) for _ in range(5)]
    tests = [f"assert count_multiples({n}) == {sum(1 for k in range(1, n + 1) if k % a == 0 or k % b == 0)}"
             for n in ns]
    return _task(f"Write a Python function count_multiples(n) that returns how many integers from 1 to n are "
                 f"divisible by {a} or by {b}. Test it with the python tool, then give the function's code as "
                 "your answer.", tests, f"""
        def count_multiples(n):
            return sum(1 for k in range(1, n + 1) if k % {a} == 0 or k % {b} == 0)

        print(count_multiples(100))""", check="tests")


FAMILIES: tuple[tuple[Callable[[random.Random], Task], int], ...] = (
    (sum_primes, 3), (count_primes, 2), (divisors, 3), (fib_mod, 3), (multiples, 3), (powmod, 2),
    (digit_sum, 3), (lcm3, 2), (revenue, 3), (count_rows, 3), (top_product, 2), (write_function, 1),
)


def generate() -> tuple[list[Task], list[Task]]:
    """(train, test): distinct questions, test questions never in train."""
    r = random.Random(SEED)
    families = [f for f, w in FAMILIES for _ in range(w)]
    seen: set[str] = set()
    tasks: list[Task] = []
    while len(tasks) < N_TRAIN + N_TEST:
        family = families[len(tasks) % len(families)]
        t = family(r)
        if t["question"] in seen:
            continue
        seen.add(t["question"])
        t["meta"]["family"] = family.__name__
        tasks.append(t)
    r.shuffle(tasks)
    for split, part in (("train", tasks[:N_TRAIN]), ("test", tasks[N_TRAIN:])):
        for i, t in enumerate(part):
            t["id"] = f"code-{split}-{i}"
    return tasks[:N_TRAIN], tasks[N_TRAIN:]


def demo_actions(task: Task) -> list[str]:
    """A scripted solution: run the reference program with the python tool, then answer (the code, for
    "tests" tasks; the printed value otherwise)."""
    call = json.dumps({"name": "python", "arguments": {"code": task["meta"]["program"]}})
    answer = task["meta"]["program"] if task["meta"]["check"] == "tests" else str(task["ground_truth"])
    return [f"<tool_call>\n{call}\n</tool_call><|im_end|>", f"<answer>{answer}</answer><|im_end|>"]


def _jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in records), encoding="utf-8")


def write(out: Path = OUT_DIR) -> None:
    train, test = generate()
    out.mkdir(parents=True, exist_ok=True)
    _jsonl(out / "train.jsonl", train)
    _jsonl(out / "test.jsonl", test)
    _jsonl(out / "sft_demos.jsonl", [{"task_index": i, "actions": demo_actions(t)} for i, t in enumerate(train)])


if __name__ == "__main__":
    write()
    print(f"wrote {OUT_DIR}/train.jsonl ({N_TRAIN}), test.jsonl ({N_TEST}), sft_demos.jsonl")
