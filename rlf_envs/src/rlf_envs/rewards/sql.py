"""SQL verifier: run the predicted and the gold query on a SQLite database and compare result sets.

The database is opened read-only (`mode=ro` URI) with `PRAGMA query_only`, an authorizer that only
allows reads (no ATTACH, PRAGMA, writes, temp tables), a progress handler enforcing the deadline, caps
on rows, on string/blob size and on the result set's total size, and runs in a worker thread so the
event loop never blocks.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from rlf_envs.rewards.common import ConfiguredVerifier, LoopSemaphore
from rlf_envs.rewards.config import BuildContext, VerifierConfig, register_verifier
from rlf_envs.types import Score, Task, Trajectory

_ALLOWED_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, getattr(sqlite3, "SQLITE_RECURSIVE", 33)}
)
_FENCE = re.compile(r"```(?:sql|sqlite)?\s*(.*?)```", re.DOTALL | re.IGNORECASE)
_STRINGS = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|--[^\n]*|/\*.*?\*/", re.DOTALL)
_PARENS = re.compile(r"\([^()]*\)")
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)
_LEADING_WORD = re.compile(r"[\s(]*([A-Za-z]+)")


class SqlQueryError(Exception):
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


def run_readonly_query(
    db_path: str | Path,
    sql: str,
    *,
    timeout_s: float = 5.0,
    max_rows: int = 10_000,
    max_value_bytes: int = 1_000_000,
    max_result_bytes: int = 32_000_000,
) -> list[tuple[Any, ...]]:
    """Run one read-only SELECT and return up to `max_rows` rows (at most `max_result_bytes` in all); raise
    `SqlQueryError` otherwise (blocking)."""
    first = _LEADING_WORD.match(_STRINGS.sub(" ", sql))
    if first is None or first.group(1).upper() not in {"SELECT", "WITH", "VALUES"}:
        raise SqlQueryError("denied", "only read-only queries starting with SELECT, WITH or VALUES are allowed")
    path = Path(db_path)
    if not path.is_file():
        raise FileNotFoundError(f"SQLite database not found: {path}")
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=1.0, isolation_level=None)
    try:
        conn.execute("PRAGMA query_only = ON")
        # temp_store stays FILE: a hostile ORDER BY over an endless CTE then spills ~15 MB/s to deleted temp
        # files until the deadline, instead of growing our heap by ~130 MB/s (measured).
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_value_bytes)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 100_000)
        conn.set_authorizer(_authorizer)
        deadline = time.monotonic() + timeout_s
        conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
        try:
            cur = conn.execute(sql)
            rows = _fetch_bounded(cur, max_rows, max_result_bytes)
        except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError, MemoryError) as e:
            msg = str(e)
            if "interrupted" in msg or time.monotonic() > deadline:
                raise SqlQueryError("timeout", f"query exceeded {timeout_s}s") from None
            if any(k in msg for k in ("not authorized", "authorization denied", "readonly")):
                raise SqlQueryError("denied", f"only read-only SELECT queries are allowed ({msg})") from None
            raise SqlQueryError("error", f"{type(e).__name__}: {msg}") from None
        if len(rows) > max_rows:
            raise SqlQueryError("too_many_rows", f"more than {max_rows} rows")
        return rows
    finally:
        conn.close()


def extract_sql(answer: str) -> str:
    """The SQL in an answer: the last fenced block if any, without trailing semicolons."""
    blocks = _FENCE.findall(answer)
    sql = blocks[-1] if blocks else answer
    return sql.strip().rstrip(";").strip()


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

    @field_validator("db_path")
    @classmethod
    def _exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"no SQLite file at {v!r}; give an existing path, or leave it unset to use task.meta")
        return v

    def build(self, ctx: BuildContext) -> SqlVerifier:
        return SqlVerifier(self)


class SqlVerifier(ConfiguredVerifier[SqlConfig]):
    config_cls = SqlConfig

    def __init__(self, config: SqlConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self._gate = LoopSemaphore(self.cfg.max_concurrency)

    async def _run(self, db: str, sql: str) -> list[tuple[Any, ...]]:
        c = self.cfg
        async with self._gate.get():
            return await asyncio.to_thread(
                run_readonly_query, db, sql, timeout_s=c.timeout_s, max_rows=c.max_rows,
                max_value_bytes=c.max_value_bytes, max_result_bytes=c.max_result_bytes,
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
        try:
            gold = await self._run(str(db), extract_sql(gold_sql))
        except SqlQueryError as e:
            raise ValueError(f"task {task.id!r}: gold query failed ({e.kind}): {e}") from None
        try:
            pred = await self._run(str(db), extract_sql(trajectory.answer))
        except SqlQueryError as e:
            return self.result(0.0, {f"pred_{e.kind}": 1.0})
        ordered = c.order == "ordered" or (c.order == "auto" and has_top_level_order_by(gold_sql))
        ok = results_equal(pred, gold, ordered=ordered, compare=c.compare, float_digits=c.float_digits)
        return self.result(float(ok), {"pred_rows": len(pred)})
