"""SQL verifier: run the predicted and the gold query on a SQLite database and compare result sets.

The database is opened read-only (`mode=ro` URI) with `PRAGMA query_only`, an authorizer that only
allows reads (no ATTACH, PRAGMA, writes, temp tables), a progress handler enforcing the deadline, caps
on rows, on string/blob size and on the result set's total size.

Connections are reused (`reuse=True`, the default): one idle set per database file (keyed by path, inode,
size and mtime, so a replaced file gets new connections), each set up once as above and handed to one
query at a time. A connection goes back after a query that ended (rows, a row/size cap,
or a denied, failed or interrupted one) with no transaction open and no change made, else (or after a
MemoryError) it is closed. What a query could otherwise leave for the next one is denied by the authorizer
(PRAGMA, ATTACH, temp tables, writes, transactions), and the per-query settings (deadline handler,
value-size limit) are set by every query and cleared after (tests/envs/rewards/test_rewards_sql.py checks each).

`run_readonly_query_async` runs a query on the event loop's thread while it takes under `inline_s` (SQLite's
progress handler checks every 1,000 steps), and only a longer one again in a worker thread with its full
deadline: most text-to-SQL queries take microseconds, less than a thread hop.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import sqlite3
import stat
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from pydantic import Field, field_validator

from rlf_envs.errors import RlfError
from rlf_envs.rewards.common import ConfiguredVerifier, LoopSemaphore
from rlf_envs.rewards.config import BuildContext, VerifierConfig, register_verifier
from rlf_envs.types import Score, Task, Trajectory

V = TypeVar("V")

_ALLOWED_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, getattr(sqlite3, "SQLITE_RECURSIVE", 33)}
)
_FENCE = re.compile(r"```(?:sql|sqlite)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)
_STRINGS = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|--[^\n]*|/\*.*?\*/", re.DOTALL)
_PARENS = re.compile(r"\([^()]*\)")
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)
_LEADING_WORD = re.compile(r"[\s(]*([A-Za-z]+)")


class SqlQueryError(RlfError):
    """A query failed: syntax error, denied operation, deadline, or a cap exceeded. `kind` says which."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _authorizer(action: int, *_: Any) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED_ACTIONS else sqlite3.SQLITE_DENY


def _row_bytes(row: tuple[Any, ...]) -> int:
    """Roughly what a row holds in memory: string/blob lengths, 8 bytes per other value."""
    return sum(len(v) if isinstance(v, str | bytes) else 8 for v in row)


def _fetch_bounded(cur: sqlite3.Cursor, max_rows: int, max_result_bytes: int) -> list[tuple[Any, ...]]:
    """Up to max_rows + 1 rows, one at a time, so that `max_result_bytes` is never exceeded by more than one row
    (500 rows x 4 values x 1 MB reached 1.7 GB when only rows and value sizes were capped)."""
    rows: list[tuple[Any, ...]] = []
    total = 0
    while len(rows) <= max_rows:
        row = cur.fetchone()
        if row is None:
            break
        total += _row_bytes(row)
        if total > max_result_bytes:
            raise SqlQueryError("too_large", f"the result set is larger than {max_result_bytes:,} bytes")
        rows.append(row)
    return rows


class OverBudget(Exception):
    """The inline attempt of `run_readonly_query_async` ran past its budget: run it in a thread instead."""


_Key = tuple[str, int, int, int, int]


class _Connections:
    """Idle read-only connections per database file, at most `per_db` each and `max_dbs` files (LRU)."""

    def __init__(self, per_db: int = 8, max_dbs: int = 64) -> None:
        self.per_db, self.max_dbs = per_db, max_dbs
        self._idle: OrderedDict[_Key, list[sqlite3.Connection]] = OrderedDict()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def take(self, key: _Key) -> sqlite3.Connection | None:
        with self._lock:
            if self._pid != os.getpid():  # a forked child: never share the parent's connections
                self._idle.clear()
                self._pid = os.getpid()
            conns = self._idle.get(key)
            if conns:
                self._idle.move_to_end(key)
                return conns.pop()
            return None

    def give_back(self, key: _Key, conn: sqlite3.Connection) -> None:
        evicted: list[sqlite3.Connection] = []
        with self._lock:
            conns = self._idle.setdefault(key, [])
            self._idle.move_to_end(key)
            if len(conns) < self.per_db:
                conns.append(conn)
            else:
                evicted.append(conn)
            while len(self._idle) > self.max_dbs:
                evicted += self._idle.popitem(last=False)[1]
        for c in evicted:
            c.close()

    def clear(self) -> None:
        with self._lock:
            conns = [c for cs in self._idle.values() for c in cs]
            self._idle.clear()
        for c in conns:
            c.close()


_CONNECTIONS = _Connections()


#: functions (and keywords) whose result is not a function of the database's bytes and the SQL text
_VOLATILE = re.compile(r"\b(random|randomblob|changes|total_changes|last_insert_rowid|date|time|datetime|julianday|"
                       r"strftime|unixepoch|timediff|current_date|current_time|current_timestamp|sqlite_offset)\b",
                       re.IGNORECASE)


class Memo(Generic[V]):
    """A thread-safe LRU memory bounded by entries and by a total size, `size_of(key, value)` per entry (an entry
    over 1/16 of the bound is not kept). Used for remembered query results (`_RESULTS`) and remembered SQL tool
    outputs (`rlf_envs.envs.sql`)."""

    def __init__(self, max_entries: int, max_size: int, size_of: Callable[[Any, V], int]) -> None:
        self.max_entries, self.max_size, self.size_of = max_entries, max_size, size_of
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
            return hit[0]

    def put(self, key: Hashable, value: V) -> None:
        size = self.size_of(key, value)
        if size > self.max_size // 16:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._size -= old[1]
            self._items[key] = (value, size)
            self._size += size
            while len(self._items) > self.max_entries or self._size > self.max_size:
                self._size -= self._items.popitem(last=False)[1][1]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._size = 0


class _Results(Memo[list[tuple[Any, ...]]]):
    """Results of deterministic read-only queries, per (database file identity, SQL, caps): a database that
    cannot change and a query without volatile functions always give the same rows (GRPO asks the same
    gold query, `list_tables` and `describe_table` many times). Bounded by entries and bytes (LRU)."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 64 << 20) -> None:
        # the rows' bytes and the key's SQL (key[1])
        super().__init__(max_entries, max_bytes, lambda key, rows: sum(map(_row_bytes, rows)) + len(key[1]) + 64)

    def get(self, key: Hashable) -> list[tuple[Any, ...]] | None:
        hit = super().get(key)
        return None if hit is None else list(hit)  # the caller's own list (rows are tuples of immutable values)

    def put(self, key: Hashable, rows: list[tuple[Any, ...]]) -> None:
        super().put(key, list(rows))


_RESULTS = _Results()


_FORGET: list[Callable[[], None]] = []


def on_forget(clear: Callable[[], None]) -> None:
    """Have `close_idle_connections` call `clear` too (another memory of results, e.g. rlf/SQL-v0's tool outputs)."""
    _FORGET.append(clear)


def close_idle_connections() -> None:
    """Close every idle reused connection (they are reopened on demand) and forget cached results."""
    _CONNECTIONS.clear()
    _RESULTS.clear()
    for clear in _FORGET:
        clear()


def _open(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=1.0, isolation_level=None,
                           check_same_thread=False)  # one query (one thread) at a time: `_Connections`
    try:
        conn.execute("PRAGMA query_only = ON")
        # temp_store stays FILE: a hostile ORDER BY over an endless CTE then spills ~15 MB/s to deleted temp
        # files until the deadline, instead of growing our heap by ~130 MB/s (measured).
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 100_000)
        conn.set_authorizer(_authorizer)
    except BaseException:
        conn.close()
        raise
    return conn


def database_key(path: str) -> _Key:
    """The identity of the database file now (path, device, inode, size, mtime): a replaced or modified file
    gets a new key, so neither a reused connection nor a remembered result of the old one is used for it."""
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        raise FileNotFoundError(f"SQLite database not found: {path}")
    return (path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _analyse(sql: str) -> tuple[bool, bool]:
    """(starts like a read-only query, uses no volatile function), from the text outside string literals."""
    code = _STRINGS.sub(" ", sql)
    first = _LEADING_WORD.match(code)
    return (first is not None and first.group(1).upper() in {"SELECT", "WITH", "VALUES"},
            _VOLATILE.search(code) is None)


def deterministic_read(sql: str) -> bool:
    """True when `sql` starts like a read-only query and uses no volatile function: its result on an unchanged
    database file is what `run_readonly_query(cache=True)` remembers."""
    readonly, deterministic = _analyse(sql)
    return readonly and deterministic


def run_readonly_query(
    db_path: str | Path,
    sql: str,
    *,
    timeout_s: float = 5.0,
    max_rows: int = 10_000,
    max_value_bytes: int = 1_000_000,
    max_result_bytes: int = 32_000_000,
    reuse: bool = True,
    cache: bool = True,
    _budget_s: float | None = None,
    _key: _Key | None = None,
) -> list[tuple[Any, ...]]:
    """Run one read-only SELECT and return up to `max_rows` rows (at most `max_result_bytes` in all); raise
    `SqlQueryError` otherwise (blocking). `reuse`: take an idle connection to this database and give it back
    after a clean query (see the module docstring); False opens and closes one for this query. `cache`: answer
    a deterministic query (no random/date/time/changes functions) asked before of the same unchanged
    database file from memory; errors are never cached (the query runs again). `_key`: the file's
    `database_key`, taken once by a caller that runs several queries of one call (one `stat`, not one each)."""
    readonly, deterministic = _analyse(sql)
    if not readonly:
        raise SqlQueryError("denied", "only read-only queries starting with SELECT, WITH or VALUES are allowed")
    path = os.fspath(db_path)
    key = _key if _key is not None and _key[0] == path else database_key(path)
    result_key = (key, sql, max_rows, max_value_bytes, max_result_bytes)
    cacheable = cache and deterministic
    if cacheable and (hit := _RESULTS.get(result_key)) is not None:
        return hit
    conn = _CONNECTIONS.take(key) if reuse else None
    if conn is None:
        conn = _open(Path(path))
    clean = False
    try:
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_value_bytes)
        deadline = time.monotonic() + timeout_s
        stop = deadline if _budget_s is None else min(deadline, time.monotonic() + _budget_s)
        conn.set_progress_handler(lambda: int(time.monotonic() > stop), 1000)
        cur = None
        try:
            cur = conn.execute(sql)
            rows = _fetch_bounded(cur, max_rows, max_result_bytes)
        except SqlQueryError:
            clean = True  # a cap: the statement is finalised below, the connection is as it was
            raise
        except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError, MemoryError) as e:
            # denied at prepare, failed, or interrupted by our handler: the statement is finalised below and
            # the `finally` checks that nothing is open or changed before the connection is reused
            clean = not isinstance(e, MemoryError)
            msg = str(e)
            if "interrupted" in msg or time.monotonic() > stop:
                if _budget_s is not None and time.monotonic() <= deadline:
                    raise OverBudget() from None
                raise SqlQueryError("timeout", f"query exceeded {timeout_s}s") from None
            if any(k in msg for k in ("not authorized", "authorization denied", "readonly")):
                raise SqlQueryError("denied", f"only read-only SELECT queries are allowed ({msg})") from None
            raise SqlQueryError("error", f"{type(e).__name__}: {msg}") from None
        finally:
            if cur is not None:
                cur.close()
            conn.set_progress_handler(None, 0)
        if len(rows) > max_rows:
            clean = True
            raise SqlQueryError("too_many_rows", f"more than {max_rows} rows")
        clean = True
        if cacheable:
            _RESULTS.put(result_key, rows)
        return rows
    finally:
        if reuse and clean and not conn.in_transaction and conn.total_changes == 0:
            _CONNECTIONS.give_back(key, conn)
        else:
            conn.close()


async def run_readonly_query_async(db_path: str | Path, sql: str, *, inline_s: float = 0.002,
                                   **kwargs: Any) -> list[tuple[Any, ...]]:
    """`run_readonly_query` without blocking the event loop for long: tried on the loop's thread for at most
    `inline_s` (0: never), and if it needs longer, run from the start in a worker thread with its full
    deadline (a read-only query gives the same rows when run again)."""
    if inline_s > 0:
        try:
            return run_readonly_query(db_path, sql, _budget_s=inline_s, **kwargs)
        except OverBudget:
            pass
    return await asyncio.to_thread(run_readonly_query, db_path, sql, **kwargs)


@functools.lru_cache(maxsize=4096)  # pure; GRPO scores the same gold and answers often
def extract_sql(answer: str) -> str:
    """The SQL in an answer: the last fenced block if any, without trailing semicolons."""
    blocks = _FENCE.findall(answer)
    sql = blocks[-1] if blocks else answer
    return sql.strip().rstrip(";").strip()


@functools.lru_cache(maxsize=4096)
def has_top_level_order_by(sql: str) -> bool:
    """True if the outermost query has ORDER BY (ignoring strings, comments and parenthesised subqueries)."""
    s = _STRINGS.sub("''", sql)
    prev = None
    while prev != s:
        prev, s = s, _PARENS.sub("", s)
    return _ORDER_BY.search(s) is not None


def _norm_value(v: Any, digits: int | None) -> Any:
    if isinstance(v, float):
        if digits is not None:
            v = round(v, digits)
        return int(v) if v.is_integer() else v
    return v


def results_equal(
    pred: list[tuple[Any, ...]], gold: list[tuple[Any, ...]], *, ordered: bool, compare: str = "multiset",
    float_digits: int | None = 6,
) -> bool:
    """Compare result sets: in order if `ordered`, else as multisets (or sets)."""
    if pred == gold:  # the same rows in the same order are equal in every mode (SQLite returns no NaN)
        return True
    p = [tuple(_norm_value(v, float_digits) for v in r) for r in pred]
    g = [tuple(_norm_value(v, float_digits) for v in r) for r in gold]
    if ordered:
        return p == g
    if compare == "set":
        return set(p) == set(g)
    return Counter(p) == Counter(g)


@register_verifier
class SqlConfig(VerifierConfig):
    """Execution match for text-to-SQL. The answer is the predicted query; the gold query is
    `task.ground_truth` (or `task.meta[gold_key]`); the database is `db_path` or `task.meta[db_key]`."""

    type: Literal["sql"] = "sql"
    db_path: str | None = None
    db_key: str = "db_path"
    gold_key: str | None = None
    timeout_s: float = Field(5.0, gt=0)
    max_rows: int = Field(10_000, ge=1)
    max_value_bytes: int = Field(1_000_000, ge=1024)
    max_result_bytes: int = Field(32_000_000, ge=1024, description="cap on a result set's total size")
    order: Literal["auto", "ordered", "unordered"] = "auto"
    compare: Literal["multiset", "set"] = "multiset"
    float_digits: int | None = Field(6, ge=0)
    max_concurrency: int = Field(4, ge=1)
    reuse_connections: bool = Field(True, description="reuse read-only connections per database (false: one "
                                    "per query, the slower path before reuse)")
    inline_s: float = Field(0.002, ge=0, description="run a query on the event loop while it takes under this "
                            "long, else in a worker thread (0: always a thread)")
    cache_results: bool = Field(True, description="answer a deterministic query asked before of the same "
                                "unchanged database from memory, and the verdict on two such queries (false: "
                                "always run them)")

    @field_validator("db_path")
    @classmethod
    def _exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"no SQLite file at {v!r}; give an existing path, or leave it unset to use task.meta")
        return v

    def build(self, ctx: BuildContext) -> SqlVerifier:
        return SqlVerifier(self)


class SqlVerifier(ConfiguredVerifier[SqlConfig]):
    """Execution match for text-to-SQL: the predicted and the gold query run read-only on the task's database and
    their result sets are compared, so any query that returns the right rows scores (see the module docstring for
    what a query may not do)."""

    config_cls = SqlConfig

    def __init__(self, config: SqlConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._gate = LoopSemaphore(self.cfg.max_concurrency)
        c = self.cfg  # what a verdict depends on besides the file and the two queries (a deadline changes no rows)
        self._verdict_cfg = ("verdict", c.order, c.compare, c.float_digits, c.max_rows, c.max_value_bytes,
                             c.max_result_bytes)

    async def _run(self, db: str, sql: str, key: _Key | None = None) -> list[tuple[Any, ...]]:
        c = self.cfg
        async with self._gate.get():
            return await run_readonly_query_async(
                db, sql, inline_s=c.inline_s, timeout_s=c.timeout_s, max_rows=c.max_rows,
                max_value_bytes=c.max_value_bytes, max_result_bytes=c.max_result_bytes, reuse=c.reuse_connections,
                cache=c.cache_results, _key=key,
            )

    async def score(self, trajectory: Trajectory, task: Task) -> Score:
        c = self.cfg
        db = c.db_path or task.meta.get(c.db_key)
        if not db:
            raise ValueError(f"task {task.id!r}: no database (set db_path or task.meta[{c.db_key!r}])")
        gold_sql = task.meta.get(c.gold_key) if c.gold_key else task.ground_truth
        if not isinstance(gold_sql, str) or not gold_sql.strip():
            raise ValueError(f"task {task.id!r}: gold SQL missing or not a string: {gold_sql!r}")
        if trajectory.answer is None or not extract_sql(trajectory.answer):
            return self.result(0.0, {"no_answer": 1.0})
        key = database_key(str(db))  # gold and answer run on the same file identity (one stat)
        gold_q, pred_q = extract_sql(gold_sql), extract_sql(trajectory.answer)
        memo = None
        if c.cache_results and deterministic_read(gold_q) and deterministic_read(pred_q):
            # both results are remembered for this file anyway: so is their comparison (with the results, in
            # `_RESULTS`; the answer's text is the entry's size). Only a comparison is remembered, never an error.
            memo = (key, pred_q, gold_sql, *self._verdict_cfg)
            if (hit := _RESULTS.get(memo)) is not None:
                [(value, n_rows)] = hit
                return self.result(value, {"pred_rows": n_rows})
        try:
            gold = await self._run(str(db), gold_q, key)
        except SqlQueryError as e:
            raise ValueError(f"task {task.id!r}: gold query failed ({e.kind}): {e}") from None
        try:
            pred = await self._run(str(db), pred_q, key)
        except SqlQueryError as e:
            return self.result(0.0, {f"pred_{e.kind}": 1.0})
        ordered = c.order == "ordered" or (c.order == "auto" and has_top_level_order_by(gold_sql))
        ok = float(results_equal(pred, gold, ordered=ordered, compare=c.compare, float_digits=c.float_digits))
        if memo is not None:
            _RESULTS.put(memo, [(ok, len(pred))])
        return self.result(ok, {"pred_rows": len(pred)})
