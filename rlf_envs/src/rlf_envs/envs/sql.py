"""`rlf/SQL-v0`: answer a question about a SQLite database with one SQL query, after exploring it with tools.

Tools (shared by every env of the process; each call runs on the episode's own database):
`list_tables()`, `describe_table(table)` (its CREATE statement and a few rows) and `run_query(sql)`
(read-only, with a deadline and caps on rows and value sizes). The episode ends with the final query
inside `<answer></answer>`; the reward is 1 when its result set equals the gold query's (in order only
when the gold query orders: `rlf_envs.rewards.sql`).

The policy can never modify a database: every query goes through `rlf_envs.rewards.sql.run_readonly_query`
(a `mode=ro` connection, `PRAGMA query_only`, an authorizer that allows only reads, no ATTACH, a deadline
enforced by SQLite's progress handler, a row cap). The database is bound by the env, not chosen by the
policy: the env adds it to each call as an object no JSON argument can forge.

Data: by default the shipped invented databases and questions (`rlf_envs.data.sql`); or any Spider/BIRD
data set: `gym.make("rlf/SQL-v0", questions="dev.json", db_dir="database/")`.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlf_envs.env.tool_env import PendingStep, ToolEnv
from rlf_envs.rewards.sql import (
    Memo,
    OverBudget,
    SqlQueryError,
    database_key,
    deterministic_read,
    on_forget,
    run_readonly_query,
)
from rlf_envs.tools.base import InvalidArguments, Tool, ToolError, ToolSpec
from rlf_envs.tools.limits import Limiter
from rlf_envs.types import Task, ToolCall

SYSTEM_PROMPT = (
    "You answer questions about a SQLite database by writing one SQL query. Explore the database with the "
    "tools, then give your final query inside <answer></answer>."
)


@dataclass(frozen=True, slots=True)
class Database:
    """The database an episode runs on (bound to each tool call by the env). `budget_s` is set by the tool
    itself while it tries a call on the event loop's thread."""

    path: str
    budget_s: float | None = None
    #: the file's identity (`database_key`), taken once per tool call and shared by its queries
    key: tuple[str, int, int, int, int] | None = None


@dataclass(frozen=True, slots=True)
class QueryLimits:
    """Limits of one tool query: deadline (SQLite's own, checked every 1,000 VM steps), rows shown, and
    the largest value (longer strings/blobs are an error, not a huge observation). `reuse_connections` and
    `inline_s` and `cache_results` are how queries run (see `rlf_envs.rewards.sql`): reused read-only
    connections, a call run on the event loop while it takes under `inline_s` (else again in a worker
    thread), deterministic results of an unchanged database remembered (and the tools' rendered outputs of
    them, `_OUTPUTS`); False / 0 / False give the path before (a new connection per query, always a thread,
    always run)."""

    timeout_s: float = 2.0
    max_rows: int = 20
    max_value_bytes: int = 4096
    max_cell_chars: int = 120
    reuse_connections: bool = True
    inline_s: float = 0.002
    cache_results: bool = True


def _cell(v: Any, max_chars: int) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, bytes):
        return f"<blob {len(v)} bytes>"
    s = str(v)
    return s if len(s) <= max_chars else s[:max_chars] + "..."


def render_rows(rows: Sequence[tuple[Any, ...]], max_cell_chars: int = 120) -> str:
    """Rows as `a | b` lines ("(no rows)" when empty)."""
    if not rows:
        return "(no rows)"
    return "\n".join(" | ".join(_cell(v, max_cell_chars) for v in r) for r in rows)


#: What successful SQL tool calls answered, per (tool, database file identity, arguments), for calls whose every
#: query is deterministic: the same call on the same unchanged file gives the same text (a GRPO group repeats
#: list_tables, describe_table and its queries), so a repeat costs the file's `stat` and a lookup instead of reading
#: remembered rows and rendering them again. The file identity is taken anew by every call, so a replaced or
#: modified file misses. Errors are never remembered. Bounded by entries and characters (LRU);
#: `rlf_envs.rewards.sql.close_idle_connections` forgets them with the remembered query results.
_OUTPUTS: Memo[str] = Memo(4096, 16 << 20, lambda key, out: len(out) + sum(map(len, key[2:])) + 64)
on_forget(_OUTPUTS.clear)


class SqlTool(Tool):
    """Base of the three SQL tools: takes the database its env bound to the call (`context`), runs blocking SQLite
    work in a thread."""

    idempotent = True
    validates_arguments = True
    takes_context = True
    #: worker threads of this tool in SQLite at once, process-wide (the caller does not gate the calls: one that
    #: runs on the loop's thread or is remembered takes no thread; one that needs a thread waits for a slot here)
    max_threads = 8

    def __init__(self, limits: QueryLimits) -> None:
        self.limits = limits
        self.timeout_s = limits.timeout_s + 2.0  # the caller's deadline: after SQLite's own has fired
        self._threads = Limiter(self.max_threads)

    def _database(self, context: Any) -> Database:
        db = context
        if not isinstance(db, Database):
            raise ToolError(f"{self.spec.name} runs only inside rlf/SQL-v0 (no database bound to this episode)")
        return db

    def _check_args(self, arguments: dict[str, Any], allowed: Iterable[str]) -> None:
        extra = sorted(set(arguments) - set(allowed))
        if extra:
            raise InvalidArguments(f"unknown argument(s) for {self.spec.name}: {', '.join(extra)}")

    def _query(self, db: Database, sql: str, max_rows: int | None = None) -> list[tuple[Any, ...]]:
        lim = self.limits
        return run_readonly_query(db.path, sql, timeout_s=lim.timeout_s, max_rows=max_rows or lim.max_rows,
                                  max_value_bytes=lim.max_value_bytes, reuse=lim.reuse_connections,
                                  cache=lim.cache_results, _budget_s=db.budget_s, _key=db.key)

    def _tables(self, db: Database) -> list[str]:
        rows = self._query(db, "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
                               "ORDER BY name", max_rows=1000)
        return [str(r[0]) for r in rows]

    async def call(self, arguments: dict[str, Any], context: Any = None) -> str:
        db = self._database(context)
        memo = self._memo(arguments) if self.limits.cache_results else None
        try:
            key = database_key(db.path)  # every call: a replaced or modified file is seen at once
            if memo is not None and (out := _OUTPUTS.get((self, key, *memo))) is not None:
                return out
            out = None
            if self.limits.inline_s > 0:
                try:  # on the loop's thread while every query of the call is quick
                    out = self._run(Database(db.path, self.limits.inline_s, key), arguments)
                except OverBudget:
                    pass  # read-only: running the call again from the start gives the same answer
            if out is None:
                async with self._threads:
                    key = database_key(db.path)  # again: the wait for a slot may have been long
                    out = await asyncio.to_thread(self._run, Database(db.path, None, key), arguments)
        except SqlQueryError as e:
            raise ToolError(str(e)) from None
        except FileNotFoundError as e:
            raise ToolError(str(e)) from None
        if memo is not None:
            _OUTPUTS.put((self, key, *memo), out)
        return out

    def _memo(self, arguments: dict[str, Any]) -> tuple[str, ...] | None:
        """The policy's arguments as the key of the call's remembered output (`_OUTPUTS`), or None where the
        output is not remembered (arguments other than the tool's own strings, a query that is not
        deterministic). Only an output is remembered, never an error: a hit is a call that succeeded before."""
        return None

    def _run(self, db: Database, arguments: dict[str, Any]) -> str:
        raise NotImplementedError


class ListTables(SqlTool):
    def __init__(self, limits: QueryLimits) -> None:
        super().__init__(limits)
        self.spec = ToolSpec("list_tables", "List the tables of the database, one per line.",
                             {"type": "object", "properties": {}})

    def _memo(self, arguments: dict[str, Any]) -> tuple[str, ...] | None:
        return () if not arguments else None  # no arguments; reads sqlite_master

    def _run(self, db: Database, arguments: dict[str, Any]) -> str:
        self._check_args(arguments, ())
        return "\n".join(self._tables(db)) or "(no tables)"


class DescribeTable(SqlTool):
    def __init__(self, limits: QueryLimits, sample_rows: int = 3) -> None:
        super().__init__(limits)
        self.sample_rows = sample_rows
        self.spec = ToolSpec(
            "describe_table", "Show a table's CREATE statement (its columns and types) and a few of its rows.",
            {"type": "object", "properties": {"table": {"type": "string", "description": "the table name"}},
             "required": ["table"]},
        )

    def _memo(self, arguments: dict[str, Any]) -> tuple[str, ...] | None:
        table = arguments.get("table")  # sqlite_master and the table's first rows: deterministic
        return (table,) if len(arguments) == 1 and isinstance(table, str) else None

    def _run(self, db: Database, arguments: dict[str, Any]) -> str:
        self._check_args(arguments, ("table",))
        name = arguments.get("table")
        if not isinstance(name, str) or not name.strip():
            raise InvalidArguments("'table' must be a non-empty string (see list_tables)")
        tables = {t.lower(): t for t in self._tables(db)}
        table = tables.get(name.strip().lower())
        if table is None:
            raise ToolError(f"no table {name.strip()[:80]!r}; tables: {', '.join(tables.values())}")
        quoted = table.replace("'", "''")
        [(create,)] = self._query(db, f"SELECT sql FROM sqlite_master WHERE type = 'table' AND name = '{quoted}'")
        ident = table.replace('"', '""')
        rows = self._query(db, f'SELECT * FROM "{ident}" LIMIT {self.sample_rows}')
        return f"{create}\nexample rows:\n{render_rows(rows, self.limits.max_cell_chars)}"


class RunQuery(SqlTool):
    def __init__(self, limits: QueryLimits) -> None:
        super().__init__(limits)
        self.spec = ToolSpec(
            "run_query",
            f"Run a read-only SQL query (SQLite) and see up to {limits.max_rows} result rows as 'a | b' lines.",
            {"type": "object", "properties": {"sql": {"type": "string", "description": "a SELECT query"}},
             "required": ["sql"]},
        )

    def _memo(self, arguments: dict[str, Any]) -> tuple[str, ...] | None:
        sql = arguments.get("sql")
        if len(arguments) == 1 and isinstance(sql, str) and deterministic_read(sql.strip().rstrip(";")):
            return (sql,)
        return None

    def _run(self, db: Database, arguments: dict[str, Any]) -> str:
        self._check_args(arguments, ("sql",))
        sql = arguments.get("sql")
        if not isinstance(sql, str) or not sql.strip():
            raise InvalidArguments("'sql' must be a non-empty string")
        try:
            rows = self._query(db, sql.strip().rstrip(";"))
        except SqlQueryError as e:
            if e.kind == "too_many_rows":
                raise ToolError(f"more than {self.limits.max_rows} rows: add LIMIT, a WHERE clause or an "
                                "aggregate") from None
            raise
        return render_rows(rows, self.limits.max_cell_chars)


_TOOLS: dict[QueryLimits, tuple[SqlTool, ...]] = {}
_TOOLS_LOCK = threading.Lock()


def sql_tools(limits: QueryLimits | None = None) -> tuple[SqlTool, ...]:
    """The process-wide SQL tools for these limits (envs share them, and so one Toolbox)."""
    limits = limits or QueryLimits()
    with _TOOLS_LOCK:
        if limits not in _TOOLS:
            _TOOLS[limits] = (ListTables(limits), DescribeTable(limits), RunQuery(limits))
        return _TOOLS[limits]


# -- tasks ------------------------------------------------------------------------------------------


def _records(path: Path) -> list[Any]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        out = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        return out
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON array of questions (Spider/BIRD format), got {type(data).__name__}")
    return data


def load_spider(questions: str | os.PathLike[str], db_dir: str | os.PathLike[str], *,
                with_evidence: bool = True) -> list[Task]:
    """Tasks from Spider/BIRD-style JSON: an array (or JSONL) of `{"question", "db_id", "query" | "SQL"}`
    (BIRD's `evidence`, when present, is added to the question as a hint); the database of `db_id` is
    `<db_dir>/<db_id>/<db_id>.sqlite` (both benchmarks' layout). Raises ValueError naming the record."""
    qpath, ddir = Path(questions), Path(db_dir)
    if not qpath.is_file():
        raise FileNotFoundError(f"questions file not found: {qpath}")
    if not ddir.is_dir():
        raise FileNotFoundError(f"database directory not found: {ddir} (Spider's `database/`, BIRD's "
                                "`dev_databases/`)")
    tasks: list[Task] = []
    for i, rec in enumerate(_records(qpath)):
        where = f"{qpath} record {i}"
        if not isinstance(rec, Mapping):
            raise ValueError(f"{where}: expected an object, got {type(rec).__name__}")
        question, db_id = rec.get("question"), rec.get("db_id")
        gold = rec.get("query", rec.get("SQL"))
        for key, val in (("question", question), ("db_id", db_id), ("query (or SQL)", gold)):
            if not isinstance(val, str) or not val.strip():
                raise ValueError(f"{where}: needs a non-empty string {key!r}")
        assert isinstance(question, str) and isinstance(db_id, str) and isinstance(gold, str)
        if Path(db_id).name != db_id or db_id in (".", ".."):
            raise ValueError(f"{where}: db_id {db_id!r} is not a plain directory name")
        db = ddir / db_id / f"{db_id}.sqlite"
        if not db.is_file():
            raise FileNotFoundError(f"{where}: no database for db_id {db_id!r} at {db}")
        evidence = rec.get("evidence")
        if with_evidence and isinstance(evidence, str) and evidence.strip():
            question = f"{question}\nHint: {evidence.strip()}"
        tid = rec.get("question_id", f"{qpath.stem}-{i}")
        tasks.append(Task(id=str(tid), question=question, ground_truth=gold,
                          meta={"db_id": db_id, "db_path": str(db.resolve())}))
    if not tasks:
        raise ValueError(f"{qpath}: no questions")
    return tasks


_SHIPPED: dict[str, tuple[Task, ...]] = {}


def sql_tasks(split: str = "train") -> list[Task]:
    """The shipped questions of `split` ("train" or "test"), on the shipped databases (built once)."""
    from rlf_envs.data.sql import database_dir, split_path

    with _TOOLS_LOCK:
        if split not in _SHIPPED:
            _SHIPPED[split] = tuple(load_spider(split_path(split), database_dir()))
        return list(_SHIPPED[split])


# -- the env ----------------------------------------------------------------------------------------


class SqlEnv(ToolEnv):
    """Text-to-SQL with exploration tools and an execution-match reward.

    Args:
        split: "train" or "test" of the shipped data (ignored when `tasks` or `questions` is given).
        questions: a Spider/BIRD JSON file (with `db_dir`): the benchmark's questions and databases.
        db_dir: the benchmark's database directory (`<db_dir>/<db_id>/<db_id>.sqlite`).
        query_timeout_s: SQLite deadline of one tool query (the verifier has its own, `verifier`).
        max_result_rows: rows a `run_query` may return (more is an error telling the policy to narrow it).
        format: "qwen3" / "hermes" (JSON tool calls) or a Format instance.
        reuse_connections: reuse read-only connections per database, for the tools and the default verifier
            (False: a new connection per query, the path before).
        inline_s: run a tool call / verifier query on the event loop while it takes under this long, else in a
            worker thread (0: always a thread, the path before).
        cache_results: answer a deterministic query (no random/date/time functions) asked before of the same
            unchanged database file from memory, for the tools (their rendered outputs) and the default verifier
            (its verdict) (False: always run).
        **kwargs: ToolEnv's (tasks: Tasks whose `meta["db_path"]` names their database, verifier,
            max_turns, tokenizer, system_prompt, extra tools...).
    """

    def __init__(
        self,
        split: str = "train",
        questions: str | os.PathLike[str] | None = None,
        db_dir: str | os.PathLike[str] | None = None,
        query_timeout_s: float = 2.0,
        max_result_rows: int = 20,
        format: Any = "qwen3",
        reuse_connections: bool = True,
        inline_s: float = 0.002,
        cache_results: bool = True,
        **kwargs: Any,
    ) -> None:
        if (questions is None) != (db_dir is None):
            raise ValueError("give both questions= (Spider/BIRD JSON) and db_dir= (its database directory), or "
                             "neither (the shipped data)")
        if query_timeout_s <= 0 or max_result_rows < 1 or inline_s < 0:
            raise ValueError("query_timeout_s must be > 0, max_result_rows >= 1 and inline_s >= 0")
        if questions is not None and db_dir is not None:
            if kwargs.get("tasks") is not None:
                raise ValueError("give tasks= or questions=, not both")
            kwargs["tasks"] = load_spider(questions, db_dir)
        elif kwargs.get("tasks") is None:
            kwargs["tasks"] = sql_tasks(split)
        tools = sql_tools(QueryLimits(timeout_s=query_timeout_s, max_rows=max_result_rows,
                                      reuse_connections=reuse_connections, inline_s=inline_s,
                                      cache_results=cache_results))
        kwargs.setdefault("verifier", {"type": "sql", "reuse_connections": reuse_connections, "inline_s": inline_s,
                                       "cache_results": cache_results})
        kwargs.setdefault("system_prompt", SYSTEM_PROMPT)
        super().__init__(tools=[*tools, *kwargs.pop("tools", ())], format=format, **kwargs)
        for t in self.tasks:
            db = t.meta.get("db_path")
            if not isinstance(db, str) or not Path(db).is_file():
                raise ValueError(f"task {t.id!r}: meta['db_path'] must name an existing SQLite file, got {db!r}")
        self._sql_tools = frozenset(t.name for t in tools)
        self._bound = Database("")

    def bind_calls(self, step: PendingStep) -> Sequence[ToolCall]:
        """The policy's calls, SQL tools bound to this episode's database (whatever arguments it sent)."""
        path = str(self.trajectory.task.meta["db_path"])
        db = self._bound
        if db.path != path:  # one binding per database, not one per step
            db = self._bound = Database(path)
        sql = self._sql_tools  # ToolCall(...) directly: dataclasses.replace re-inspects the fields per call (~9 us)
        return [ToolCall(c.name, c.arguments, c.id, context=db) if c.name in sql else c
                for c in step.turn.action.calls]
