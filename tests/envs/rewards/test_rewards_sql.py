"""SQL execution-match verifier: result-set comparison and hostile queries that must not harm host or data."""

from __future__ import annotations

import asyncio
import hashlib
import sqlite3
import time
from pathlib import Path

import pytest

from rlf_envs.rewards import SqlQueryError, SqlVerifier, build_verifier, run_readonly_query
from rlf_envs.rewards.sql import extract_sql, has_top_level_order_by, results_equal
from rlf_envs.types import Task, Trajectory


@pytest.fixture
def db(tmp_path: Path) -> Path:
    p = tmp_path / "shop.db"
    con = sqlite3.connect(p)
    con.executescript(
        """
        CREATE TABLE customer(id INTEGER PRIMARY KEY, name TEXT, city TEXT);
        CREATE TABLE orders(id INTEGER PRIMARY KEY, customer_id INTEGER, amount REAL);
        INSERT INTO customer VALUES (1,'Ann','Paris'),(2,'Bob','Lyon'),(3,'Cid','Paris'),(4,'Dee','Nice');
        INSERT INTO orders VALUES (1,1,10.5),(2,1,20.25),(3,2,5.0),(4,3,7.75),(5,3,7.75);
        """
    )
    con.commit()
    con.close()
    return p


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def traj(answer: str | None, gold: str, db: Path | None = None, tid: str = "q1") -> Trajectory:
    meta = {"db_path": str(db)} if db else {}
    return Trajectory(Task(tid, "question", gold, meta=meta), "P", [], answer)


async def run(v: SqlVerifier, t: Trajectory) -> tuple[float, dict[str, float]]:
    s = await v.safe_score(t, t.task)
    return s.value, s.info


def test_helpers() -> None:
    assert extract_sql("Here:\n```sql\nSELECT 1;\n```") == "SELECT 1"
    assert extract_sql("SELECT name FROM t ;  ") == "SELECT name FROM t"
    assert has_top_level_order_by("SELECT a FROM t ORDER BY a")
    assert not has_top_level_order_by("SELECT * FROM (SELECT a FROM t ORDER BY a LIMIT 3)")
    assert not has_top_level_order_by("SELECT 'order by' FROM t -- order by x")
    assert has_top_level_order_by("select a from t where b in (select c from u) order  by a desc")
    assert results_equal([(1, "a"), (2, "b")], [(2, "b"), (1, "a")], ordered=False)
    assert not results_equal([(1, "a"), (2, "b")], [(2, "b"), (1, "a")], ordered=True)
    assert not results_equal([(1,), (1,)], [(1,)], ordered=False)
    assert results_equal([(1,), (1,)], [(1,)], ordered=False, compare="set")
    assert results_equal([(0.1 + 0.2,)], [(0.3,)], ordered=True)
    assert results_equal([(2.0,)], [(2,)], ordered=True)
    assert not results_equal([("a", 1)], [(1, "a")], ordered=False)  # column order matters


@pytest.mark.asyncio
async def test_execution_match_cases(db: Path) -> None:
    v = SqlVerifier()
    gold = "SELECT name FROM customer WHERE city = 'Paris'"
    assert (await run(v, traj("SELECT name FROM customer WHERE city='Paris' ORDER BY name DESC", gold, db)))[0] == 1.0
    assert (await run(v, traj("```sql\nselect c.name from customer c where c.id in (1, 3);\n```", gold, db)))[0] == 1.0
    assert (await run(v, traj("SELECT name FROM customer", gold, db)))[0] == 0.0
    ordered_gold = "SELECT name FROM customer ORDER BY name DESC"
    assert (await run(v, traj("SELECT name FROM customer ORDER BY name", ordered_gold, db)))[0] == 0.0
    assert (await run(v, traj("SELECT name FROM customer ORDER BY id DESC", ordered_gold, db)))[0] == 1.0
    assert (await run(SqlVerifier(order="unordered"), traj("SELECT name FROM customer", ordered_gold, db)))[0] == 1.0
    # float aggregates compared after rounding
    assert (await run(v, traj("SELECT sum(amount) FROM orders", "SELECT 10.5+20.25+5+7.75+7.75", db)))[0] == 1.0
    # duplicates matter by default (multiset)
    dup_gold = "SELECT amount FROM orders WHERE customer_id = 3"
    assert (await run(v, traj("SELECT DISTINCT amount FROM orders WHERE customer_id = 3", dup_gold, db)))[0] == 0.0
    v_set = SqlVerifier(compare="set")
    assert (await run(v_set, traj("SELECT DISTINCT amount FROM orders WHERE customer_id = 3", dup_gold, db)))[0] == 1.0
    value, info = await run(v, traj("SELECT name FRM customer", gold, db))
    assert value == 0.0 and info["sql/pred_error"] == 1.0
    assert (await run(v, traj(None, gold, db)))[1]["sql/no_answer"] == 1.0


@pytest.mark.asyncio
async def test_config_db_path_and_bad_gold_is_logged_fallback(db: Path, caplog: pytest.LogCaptureFixture) -> None:
    v = build_verifier({"type": "sql", "db_path": str(db), "fallback": -1.0, "gold_key": "gold_sql"})
    t = Trajectory(Task("q9", "?", None, meta={"gold_sql": "SELECT count(*) FROM customer"}), "P", [], "SELECT 4")
    assert (await v.safe_score(t, t.task)).value == 1.0
    bad = Trajectory(Task("bad-gold-3", "?", None, meta={"gold_sql": "SELECT nope FROM nowhere"}), "P", [], "SELECT 1")
    s = await v.safe_score(bad, bad.task)
    assert s.value == -1.0 and s.info == {"sql/error": 1.0}
    assert "bad-gold-3" in caplog.text and "gold query failed" in caplog.text
    no_db = traj("SELECT 1", "SELECT 1", None, tid="no-db")
    assert (await SqlVerifier().safe_score(no_db, no_db.task)).info == {"sql/error": 1.0}


HOSTILE_WRITES = [
    "DROP TABLE customer",
    "DELETE FROM customer",
    "UPDATE customer SET name = 'pwned'",
    "INSERT INTO customer VALUES (99, 'x', 'y')",
    "REPLACE INTO customer VALUES (1, 'x', 'y')",
    "CREATE TABLE evil(x)",
    "CREATE TEMP TABLE evil(x)",
    "CREATE INDEX ix ON customer(name)",
    "ALTER TABLE customer ADD COLUMN z",
    "PRAGMA writable_schema = 1",
    "PRAGMA query_only = 0",
    "PRAGMA journal_mode = DELETE",
    "VACUUM",
    "SELECT 1; DROP TABLE customer",
    "SELECT load_extension('/tmp/evil.so')",
    "BEGIN IMMEDIATE",
    "REINDEX",
]


@pytest.mark.asyncio
async def test_writes_cannot_touch_the_database(db: Path, tmp_path: Path) -> None:
    before = digest(db)
    v = SqlVerifier()
    gold = "SELECT count(*) FROM customer"
    for q in HOSTILE_WRITES:
        value, info = await run(v, traj(q, gold, db))
        assert value == 0.0, q
        assert info.get("sql/pred_denied") or info.get("sql/pred_error"), (q, info)
    # files outside the database: ATTACH and VACUUM INTO must not create them
    for q in [f"ATTACH DATABASE '{tmp_path / 'att.db'}' AS a", f"VACUUM INTO '{tmp_path / 'copy.db'}'"]:
        assert (await run(v, traj(q, gold, db)))[0] == 0.0
    assert not (tmp_path / "att.db").exists() and not (tmp_path / "copy.db").exists()
    assert digest(db) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shop.db"]  # no journal / wal / shm left behind
    con = sqlite3.connect(db)
    assert con.execute("SELECT count(*), group_concat(name) FROM customer").fetchone() == (4, "Ann,Bob,Cid,Dee")
    con.close()


@pytest.mark.asyncio
async def test_infinite_query_hits_deadline_without_blocking_the_loop(db: Path) -> None:
    v = SqlVerifier(timeout_s=0.5)
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT x FROM c ORDER BY x"
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    task = asyncio.create_task(ticker())
    t0 = time.monotonic()
    try:
        results = await asyncio.gather(*(run(v, traj(endless, "SELECT 1", db, tid=f"loop{i}")) for i in range(3)))
    finally:
        task.cancel()
    elapsed = time.monotonic() - t0
    assert all(r == (0.0, {"sql": 0.0, "sql/pred_timeout": 1.0}) for r in results)
    assert elapsed < 60.0  # the 0.5 s deadline fired: the query never ends (a generous bound)
    assert ticks >= 3  # the event loop kept running while the queries ran (a blocked loop ticks at most once)


@pytest.mark.asyncio
async def test_huge_outputs_are_capped(db: Path) -> None:
    v = SqlVerifier(max_rows=1000)
    many = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 5000) SELECT x FROM c"
    assert (await run(v, traj(many, "SELECT 1", db)))[1]["sql/pred_too_many_rows"] == 1.0
    assert (await run(v, traj("SELECT randomblob(2000000000)", "SELECT 1", db)))[1]["sql/pred_error"] == 1.0
    assert (await run(v, traj("SELECT zeroblob(500000000)", "SELECT 1", db)))[1]["sql/pred_error"] == 1.0
    cross = "SELECT * FROM customer a, customer b, customer c, customer d, customer e, customer f"  # 4096 rows
    assert (await run(v, traj(cross, "SELECT 1", db)))[1]["sql/pred_too_many_rows"] == 1.0


def test_run_readonly_query_directly(db: Path) -> None:
    assert run_readonly_query(db, "SELECT count(*) FROM orders") == [(5,)]
    with pytest.raises(SqlQueryError) as ei:
        run_readonly_query(db, "DELETE FROM orders")
    assert ei.value.kind == "denied" and "read-only" in str(ei.value)
    with pytest.raises(FileNotFoundError):
        run_readonly_query(db.parent / "missing.db", "SELECT 1")
    assert not (db.parent / "missing.db").exists()  # mode=ro never creates the file


@pytest.mark.asyncio
async def test_result_set_total_size_is_capped(db: Path) -> None:
    """Rows and value sizes within their caps can still add up: 500 rows x 4 x 1 MB reached 1.7 GB."""
    import tracemalloc

    wide = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 500) "
            "SELECT zeroblob(900000), zeroblob(900000), zeroblob(900000), zeroblob(900000) FROM c")
    v = SqlVerifier(max_result_bytes=20_000_000)
    tracemalloc.start()
    try:
        _, info = await run(v, traj(wide, "SELECT 1", db))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info["sql/pred_too_large"] == 1.0
    assert peak < 200_000_000, f"{peak / 1e6:.0f} MB held while reading a capped result set"
    with pytest.raises(SqlQueryError) as ei:
        run_readonly_query(db, wide, max_result_bytes=10_000_000)
    assert ei.value.kind == "too_large" and "10,000,000 bytes" in str(ei.value)
    assert len(run_readonly_query(db, "SELECT zeroblob(1000) FROM orders", max_result_bytes=10_000)) == 5


# -- reused connections and remembered results: nothing one query does reaches the next ---------------------


def _idle(db: Path) -> list[sqlite3.Connection]:
    """The idle reused connections to `db` (test-only look inside the pool)."""
    from rlf_envs.rewards.sql import _CONNECTIONS

    return [c for key, conns in _CONNECTIONS._idle.items() if key[0] == str(db) for c in conns]


def _state(conn: sqlite3.Connection) -> tuple[object, ...]:
    """What a query could leave on a connection, read with the authorizer lifted for the look, then restored."""
    from rlf_envs.rewards.sql import _authorizer

    conn.set_authorizer(None)
    try:
        return (conn.execute("PRAGMA query_only").fetchone(), conn.execute("PRAGMA temp_store").fetchone(),
                conn.execute("PRAGMA foreign_keys").fetchone(), conn.execute("PRAGMA case_sensitive_like").fetchone(),
                conn.execute("SELECT count(*) FROM temp.sqlite_master").fetchone(),
                [r[1] for r in conn.execute("PRAGMA database_list")], conn.in_transaction, conn.total_changes)
    finally:
        conn.set_authorizer(_authorizer)


ATTEMPTS = [
    "PRAGMA query_only = OFF", "PRAGMA case_sensitive_like = ON", "PRAGMA foreign_keys = ON",
    "PRAGMA temp_store = MEMORY", "CREATE TEMP TABLE leak(x)", "CREATE TEMP VIEW leakv AS SELECT 1",
    "ATTACH DATABASE ':memory:' AS leak", "BEGIN", "SAVEPOINT leak", "INSERT INTO customer VALUES (9,'Eve','X')",
    # these reach the connection (the leading-word check passes them): multi-statement, denied at prepare,
    # pragma table-valued functions, extension loading
    "SELECT 1; PRAGMA query_only = OFF", "SELECT 1; CREATE TEMP TABLE leak(x)",
    "WITH x AS (SELECT 1) DELETE FROM orders",
    "WITH x AS (SELECT 1) INSERT INTO customer SELECT 9, 'Eve', 'X'", "SELECT * FROM pragma_query_only",
    "SELECT * FROM pragma_database_list", "SELECT load_extension('/nonexistent')",
    "SELECT * FROM customer, (SELECT 1 FROM sqlite_master WHERE name = 'x') AS t; ATTACH ':memory:' AS a",
]


def test_a_reused_connection_carries_nothing_to_the_next_query(db: Path) -> None:
    from rlf_envs.rewards.sql import close_idle_connections

    close_idle_connections()
    before = digest(db)
    assert run_readonly_query(db, "SELECT count(*) FROM customer WHERE name LIKE 'a%'") == [(1,)]
    [conn] = _idle(db)
    clean = _state(conn)
    reached = 0
    assert clean[0] == (1,) and clean[4] == (0,) and clean[5] == ["main", "temp"] and clean[6:] == (False, 0)
    for q in ATTEMPTS:
        with pytest.raises(SqlQueryError) as ei:
            run_readonly_query(db, q, cache=False)
        reached += "starting with SELECT" not in str(ei.value)
        assert _idle(db) == [conn], q  # the same connection, reused after the attempt
        assert _state(conn) == clean, q
    assert reached >= 6
    # an interrupted query (deadline), then a long one: the old deadline's handler is not left behind
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT max(x) FROM c"
    with pytest.raises(SqlQueryError) as ei:
        run_readonly_query(db, endless, timeout_s=0.05)
    assert ei.value.kind == "timeout"
    assert run_readonly_query(db, "SELECT count(*) FROM orders", timeout_s=0.05, cache=False) == [(5,)]
    time.sleep(0.1)  # that query's deadline is past; this one, on the same connection, has its own
    slow = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 300000) SELECT count(*) FROM c"
    assert run_readonly_query(db, slow, timeout_s=30.0, cache=False) == [(300000,)]
    # the value-size limit is each query's own too
    with pytest.raises(SqlQueryError):
        run_readonly_query(db, "SELECT zeroblob(5000)", max_value_bytes=4096, cache=False)
    assert len(run_readonly_query(db, "SELECT zeroblob(5000)", max_value_bytes=10_000, cache=False)[0][0]) == 5000
    with pytest.raises(SqlQueryError):
        run_readonly_query(db, "SELECT zeroblob(5000)", max_value_bytes=4096, cache=False)
    assert all(_state(c) == clean for c in _idle(db))
    assert len(_idle(db)) == 1  # one query at a time here: one connection, reused throughout
    assert run_readonly_query(db, "SELECT count(*) FROM customer WHERE name LIKE 'a%'", cache=False) == [(1,)]
    assert digest(db) == before
    assert sorted(p.name for p in db.parent.iterdir()) == ["shop.db"]


def test_remembered_results_respect_caps_volatility_and_a_changed_file(db: Path) -> None:
    many = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 50) SELECT x FROM c"
    assert len(run_readonly_query(db, many, max_rows=100)) == 50
    with pytest.raises(SqlQueryError) as ei:  # the remembered rows were read under another cap
        run_readonly_query(db, many, max_rows=10)
    assert ei.value.kind == "too_many_rows"
    assert len({run_readonly_query(db, "SELECT random()")[0][0] for _ in range(5)}) == 5  # never remembered
    assert len({run_readonly_query(db, "SELECT strftime('%f', 'now')")[0] for _ in range(2)}) >= 1
    q = "SELECT count(*) FROM customer"
    assert run_readonly_query(db, q) == [(4,)]
    got = run_readonly_query(db, q)
    got.append((99,))  # a caller's list is its own
    assert run_readonly_query(db, q) == [(4,)]
    con = sqlite3.connect(db)  # the file changes (a new database put in place): new answers
    con.execute("INSERT INTO customer VALUES (5, 'Eve', 'Lyon')")
    con.commit()
    con.close()
    assert run_readonly_query(db, q) == [(5,)]


@pytest.mark.asyncio
async def test_a_slow_query_leaves_the_loop_for_a_thread_with_the_same_answer(db: Path) -> None:
    from rlf_envs.rewards.sql import run_readonly_query_async

    slow = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 300000) SELECT sum(x) FROM c"
    t0 = time.monotonic()
    fast = await run_readonly_query_async(db, "SELECT count(*) FROM orders", inline_s=0.002, cache=False)
    assert fast == [(5,)]
    assert await run_readonly_query_async(db, slow, inline_s=0.002, cache=False) == [(300000 * 300001 // 2,)]
    assert await run_readonly_query_async(db, slow, inline_s=0.0, cache=False) == [(300000 * 300001 // 2,)]
    assert time.monotonic() - t0 < 60.0


def _verdicts(db: Path) -> list[tuple[object, ...]]:
    """The remembered verdicts on `db` (test-only look inside the results memory)."""
    from rlf_envs.rewards.sql import _RESULTS

    return [k for k in _RESULTS._items if k[0][0] == str(db) and "verdict" in k]


@pytest.mark.asyncio
async def test_remembered_verdicts_follow_the_file_the_config_and_never_an_error(db: Path) -> None:
    from rlf_envs.rewards.sql import close_idle_connections

    close_idle_connections()
    v = SqlVerifier()
    count = "SELECT count(*) FROM customer"
    for _ in range(2):  # the second verdict comes from memory, with the same score and info
        assert await run(v, traj("SELECT 4", count, db)) == (1.0, {"sql": 1.0, "sql/pred_rows": 1.0})
    assert len(_verdicts(db)) == 1
    # the same file and queries under another comparison: its own verdict, not the remembered one
    ordered_gold = "SELECT name FROM customer ORDER BY name DESC"
    assert (await run(v, traj("SELECT name FROM customer ORDER BY name", ordered_gold, db)))[0] == 0.0
    assert (await run(SqlVerifier(order="unordered"), traj("SELECT name FROM customer ORDER BY name",
                                                            ordered_gold, db)))[0] == 1.0
    assert (await run(v, traj("SELECT name FROM customer ORDER BY name", ordered_gold, db)))[0] == 0.0
    # errors, volatile queries and cache_results=False are never remembered
    assert (await run(v, traj("SELECT nope FROM customer", count, db)))[1]["sql/pred_error"] == 1.0
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT max(x) FROM c"
    assert (await run(SqlVerifier(timeout_s=0.05), traj(endless, count, db)))[1]["sql/pred_timeout"] == 1.0
    assert (await run(v, traj("SELECT 4 + 0 * random()", count, db)))[0] == 1.0
    assert (await run(SqlVerifier(cache_results=False), traj("SELECT 2 + 2", count, db)))[0] == 1.0
    assert sorted(k[1] for k in _verdicts(db)) == ["SELECT 4", "SELECT name FROM customer ORDER BY name",
                                                   "SELECT name FROM customer ORDER BY name"]
    # the file changes: the remembered verdict is not used for it
    con = sqlite3.connect(db)
    con.execute("INSERT INTO customer VALUES (5, 'Eve', 'Lyon')")
    con.commit()
    con.close()
    assert (await run(v, traj("SELECT 4", count, db)))[0] == 0.0
    assert (await run(v, traj("SELECT 5", count, db)))[0] == 1.0
    close_idle_connections()
    assert _verdicts(db) == []
