"""rlf/SQL-v0: shipped data, Spider/BIRD loader, read-only tools (hostile queries), episodes, Gymnasium
conformance in text and token mode, ToolVectorEnv."""

from __future__ import annotations

import json
import re
import sqlite3
import time
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
import tokenizers
from gymnasium.utils.env_checker import check_env
from tokenizer_support import train_bpe

import rlf_envs  # noqa: F401 - registers the ids
from rlf_envs.env import ToolVectorEnv
from rlf_envs.envs.sql import SqlEnv, load_spider, sql_tasks, sql_tools
from rlf_envs.types import Task, ToolStatus

FORGED = "__database__"  # the argument name the binding once had: a policy may still send it


def make_tokenizer() -> tokenizers.Tokenizer:
    """A byte-level BPE tokenizer trained here, offline, on the SQL env's prompt and some SQL."""
    env = SqlEnv(split="test")
    text = [env.format.render_prompt(t, env.toolbox.specs, env.system_prompt) for t in env.tasks[:20]]
    return train_bpe(text + [t.ground_truth for t in env.tasks], 500)


def call(name: str, **args: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call><|im_end|>"


def answer(sql: str) -> str:
    return f"<answer>{sql}</answer><|im_end|>"


@pytest.fixture
def spider(tmp_path: Path) -> tuple[Path, Path]:
    """A Spider-shaped fixture: database/<db_id>/<db_id>.sqlite and a JSON array of questions (one BIRD-style)."""
    db_dir = tmp_path / "database"
    (db_dir / "zoo").mkdir(parents=True)
    conn = sqlite3.connect(db_dir / "zoo" / "zoo.sqlite")
    conn.executescript("CREATE TABLE animal (id INTEGER PRIMARY KEY, name TEXT, legs INTEGER);"
                       "INSERT INTO animal VALUES (1, 'ant', 6), (2, 'bee', 6), (3, 'cat', 4), (4, 'emu', 2);")
    conn.commit()
    conn.close()
    q = tmp_path / "dev.json"
    q.write_text(json.dumps([
        {"db_id": "zoo", "question": "How many animals have 6 legs?",
         "query": "SELECT count(*) FROM animal WHERE legs = 6",
         "query_toks": ["SELECT"], "sql": {"from": {}}},
        {"db_id": "zoo", "question": "Animals by legs?", "SQL": "SELECT name FROM animal ORDER BY legs, name",
         "evidence": "legs is the number of legs", "question_id": 7},
    ]))
    return q, db_dir


def test_shipped_splits_are_disjoint_and_gold_queries_run() -> None:
    train, test = sql_tasks("train"), sql_tasks("test")
    assert 250 <= len(train) + len(test) <= 600 and len(test) >= 50
    assert not {t.question for t in train} & {t.question for t in test}
    assert {t.meta["db_id"] for t in train} == {"shop", "school", "library"}
    from rlf_envs.rewards.sql import run_readonly_query

    for t in test:  # every gold query runs on its database and most have an answer
        run_readonly_query(t.meta["db_path"], t.ground_truth)
    assert any("ORDER BY" in t.ground_truth for t in test)


def test_generator_is_deterministic_and_matches_shipped_files(tmp_path: Path) -> None:
    from rlf_envs.data.sql import DATA_DIR
    from rlf_envs.data.sql.generate import write

    write(tmp_path)
    for rel in ("train.json", "test.json", "databases/shop.sql", "databases/school.sql", "databases/library.sql"):
        assert (tmp_path / rel).read_bytes() == (DATA_DIR / rel).read_bytes(), rel


def test_spider_loader(spider: tuple[Path, Path]) -> None:
    q, db_dir = spider
    tasks = load_spider(q, db_dir)
    assert [t.id for t in tasks] == ["dev-0", "7"]
    assert tasks[0].ground_truth == "SELECT count(*) FROM animal WHERE legs = 6"
    assert tasks[1].ground_truth.startswith("SELECT name") and "Hint: legs is the number" in tasks[1].question
    assert Path(tasks[0].meta["db_path"]).is_file() and tasks[0].meta["db_id"] == "zoo"
    jsonl = q.with_suffix(".jsonl")
    jsonl.write_text("\n".join(json.dumps(r) for r in json.loads(q.read_text())) + "\n")
    assert [t.question for t in load_spider(jsonl, db_dir)] == [t.question for t in tasks]


@pytest.mark.parametrize(("records", "message"), [
    ([{"db_id": "zoo", "question": "q"}], "query (or SQL)"),
    ([{"db_id": "nope", "question": "q", "query": "SELECT 1"}], "no database for db_id 'nope'"),
    ([{"db_id": "../zoo", "question": "q", "query": "SELECT 1"}], "not a plain directory name"),
    ([{"question": "q", "query": "SELECT 1"}], "'db_id'"),
    ({"db_id": "zoo"}, "expected a JSON array"),
    ([], "no questions"),
])
def test_spider_loader_errors(spider: tuple[Path, Path], records: Any, message: str) -> None:
    q, db_dir = spider
    q.write_text(json.dumps(records))
    with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
        load_spider(q, db_dir)


def test_spider_loader_missing_paths(spider: tuple[Path, Path], tmp_path: Path) -> None:
    q, db_dir = spider
    with pytest.raises(FileNotFoundError, match="database directory"):
        load_spider(q, tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="questions file"):
        load_spider(tmp_path / "none.json", db_dir)
    with pytest.raises(ValueError, match="give both"):
        SqlEnv(questions=q)


def test_episode_on_a_spider_benchmark(spider: tuple[Path, Path]) -> None:
    q, db_dir = spider
    env = gym.make("rlf/SQL-v0", questions=str(q), db_dir=str(db_dir))
    obs, info = env.reset(seed=0, options={"task_index": 1})
    assert "list_tables" in obs and "Animals by legs?" in obs
    obs, r, term, trunc, _ = env.step(call("list_tables"))
    assert "<tool_response>\nanimal\n</tool_response>" in obs and not term
    obs, r, term, trunc, _ = env.step(call("describe_table", table="ANIMAL"))
    assert "CREATE TABLE animal" in obs and "1 | ant | 6" in obs
    obs, r, term, trunc, _ = env.step(call("run_query", sql="SELECT name FROM animal WHERE legs = 2"))
    assert "<tool_response>\nemu\n</tool_response>" in obs
    # the gold query orders: the right rows in another order earn nothing
    obs, r, term, trunc, info = env.step(answer("SELECT name FROM animal ORDER BY legs DESC"))
    assert term and r == 0.0
    env.reset(seed=0, options={"task_index": 1})
    _, r, term, _, info = env.step(answer("SELECT name FROM animal ORDER BY legs, name"))
    assert term and r == 1.0
    env.reset(seed=0, options={"task_index": 0})  # unordered gold: any row order, any equivalent query
    _, r, *_ = env.step(answer("```sql\nSELECT COUNT(id) FROM animal WHERE legs > 5;\n```"))
    assert r == 1.0
    traj = env.unwrapped.trajectory
    assert traj.reward == 1.0


def test_trajectory_records_the_policys_calls_not_the_binding() -> None:
    env = SqlEnv(split="test")
    env.reset(seed=0, options={"task_index": 0})
    env.step(call("list_tables"))
    [result] = env.trajectory.turns[0].results
    assert result.ok and result.call.arguments == {} and result.call.context is None  # the binding is not kept


HOSTILE = [
    ("DROP TABLE customers", "read-only"),
    ("SELECT 1; DROP TABLE customers", ""),
    ("ATTACH DATABASE '/tmp/x.db' AS x", "read-only"),
    ("PRAGMA writable_schema = ON", "read-only"),
    ("WITH t(x) AS (SELECT 1) DELETE FROM customers", ""),
    ("SELECT * FROM customers; INSERT INTO customers VALUES (999, 'x', 'y')", ""),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT max(x) FROM c", "exceeded"),
    ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 3000000) SELECT x FROM c", "more than"),
    ("SELECT a.id FROM orders a, orders b, orders c", "more than"),
    ("SELECT zeroblob(100000)", "too big"),
    ("SELECT load_extension('/tmp/evil.so')", ""),
]


def test_hostile_queries_are_errors_and_change_nothing() -> None:
    tasks = [t for t in sql_tasks("train") if t.meta["db_id"] == "shop"]
    db = Path(tasks[0].meta["db_path"])
    before = db.read_bytes()
    env = SqlEnv(tasks=tasks[:1], query_timeout_s=0.5, max_turns=len(HOSTILE) + 2)
    env.reset(seed=0)
    for sql, why in HOSTILE:
        t0 = time.monotonic()
        obs, r, term, trunc, info = env.step(call("run_query", sql=sql))
        [res] = env.trajectory.turns[-1].results
        assert res.status is ToolStatus.ERROR, (sql, res.content)
        assert why.lower() in res.content.lower(), (sql, res.content)
        assert time.monotonic() - t0 < 30  # the deadline fired (generous bound on a loaded box)
        assert not term and not trunc
    # a hostile final answer scores 0, and the database is untouched
    _, r, term, _, info = env.step(answer("DROP TABLE orders"))
    assert term and r == 0.0
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0] == 400
    finally:
        conn.close()
    assert db.read_bytes() == before


def test_tools_refuse_unbound_or_forged_databases(tmp_path: Path) -> None:
    """Outside rlf/SQL-v0 (a plain Tools-v0 given the tools) the policy cannot pick a database by path, and inside
    it an argument naming one is refused (the episode's database is the call's context, not an argument)."""
    secret = tmp_path / "secret.sqlite"
    conn = sqlite3.connect(secret)
    conn.executescript("CREATE TABLE secret (v TEXT); INSERT INTO secret VALUES ('hunter2');")
    conn.close()
    env = gym.make("rlf/Tools-v0", tools=list(sql_tools()), tasks=[Task("t", "q", "SELECT 1")]).unwrapped
    env.reset(seed=0)
    env.step(call("run_query", sql="SELECT v FROM secret", **{FORGED: str(secret)}))
    [res] = env.trajectory.turns[-1].results
    assert res.status is ToolStatus.ERROR and "only inside rlf/SQL-v0" in res.content
    sql_env = SqlEnv(split="test")
    sql_env.reset(seed=0, options={"task_index": 0})
    sql_env.step(call("run_query", sql="SELECT v FROM secret", **{FORGED: str(secret)}))
    [res] = sql_env.trajectory.turns[-1].results
    assert "hunter2" not in res.content and f"unknown argument(s) for run_query: {FORGED}" in res.content
    sql_env.step(call("run_query", sql="SELECT v FROM secret"))  # the episode's own database has no such table
    [res] = sql_env.trajectory.turns[-1].results
    assert "hunter2" not in res.content and "no such table" in res.content


def test_tool_argument_errors() -> None:
    env = SqlEnv(split="test", max_turns=8)
    env.reset(seed=0, options={"task_index": 0})
    cases = [
        (call("describe_table", table="nope"), ToolStatus.ERROR, "no table 'nope'; tables:"),
        (call("describe_table"), ToolStatus.INVALID_ARGS, "'table' must be"),
        (call("run_query", sql=""), ToolStatus.INVALID_ARGS, "'sql' must be"),
        (call("run_query", query="SELECT 1"), ToolStatus.INVALID_ARGS, "unknown argument"),
        (call("run_query", sql="SELEC 1"), ToolStatus.ERROR, "only read-only"),
        (call("run_query", sql="SELECT nope FROM customers"), ToolStatus.ERROR, "no such"),
    ]
    for action, status, message in cases:
        env.step(action)
        [res] = env.trajectory.turns[-1].results
        assert res.status is status and message in res.content, (action, res.content)


def test_env_rejects_tasks_without_a_database() -> None:
    with pytest.raises(ValueError, match=r"meta\['db_path'\]"):
        SqlEnv(tasks=[Task("t", "q", "SELECT 1")])


def test_check_env_text_and_token_mode() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_env(gym.make("rlf/SQL-v0", split="test").unwrapped, skip_render_check=True)
        check_env(gym.make("rlf/SQL-v0", split="test", tokenizer=make_tokenizer()).unwrapped, skip_render_check=True)


def test_token_mode_episode_keeps_exact_ids() -> None:
    tok = make_tokenizer()
    env = SqlEnv(split="test", tokenizer=tok)
    task = env.tasks[0]
    obs, _ = env.reset(seed=0, options={"task_index": 0})
    a1 = tok.encode(call("list_tables")).ids
    obs1, *_ = env.step(a1)
    a2 = tok.encode(answer(task.ground_truth)).ids
    _, r, term, _, _ = env.step(a2)
    traj = env.trajectory
    assert term and r == 1.0
    assert traj.token_ids == [*obs.tolist(), *a1, *obs1.tolist(), *a2]
    assert traj.loss_mask == [0] * len(obs) + [1] * len(a1) + [0] * len(obs1) + [1] * len(a2)


def test_vector_env_runs_episodes_on_their_own_databases() -> None:
    """Envs of one batch on different databases: each call runs on its own episode's database."""
    tasks = sql_tasks("test")
    by_db = {t.meta["db_id"]: i for i, t in reversed(list(enumerate(tasks)))}
    venv = gym.make_vec("rlf/SQL-v0", num_envs=3, split="test")
    assert isinstance(venv, ToolVectorEnv)
    from rlf_envs import runtime

    async def episode() -> dict[int, Any]:
        await venv.areset_envs({k: {"task_index": i} for k, i in enumerate(by_db.values())})
        listed = await venv.astep_active({k: call("list_tables") for k in range(3)})
        done = await venv.astep_active({k: answer(tasks[i].ground_truth) for k, i in enumerate(by_db.values())})
        return {k: (listed[k].obs, done[k].reward) for k in range(3)}

    out = runtime.run(episode())
    for k, db_id in enumerate(by_db):
        tables = {"shop": "customers", "school": "students", "library": "authors"}[db_id]
        assert tables in out[k][0] and out[k][1] == 1.0
    obs, info = venv.reset(seed=1)
    obs, rewards, term, trunc, info = venv.step([answer("SELECT 1")] * 3)
    assert term.all() and (rewards == 0.0).all()
    venv.close()


def test_each_tool_call_sees_the_database_file_as_it_is_now(tmp_path: Path) -> None:
    """A call takes the file's identity once (one stat shared by its queries); the next call takes it again,
    so a database replaced between two calls is seen at once, and a vanished one is a tool error."""
    import asyncio
    import os

    from rlf_envs.envs.sql import Database
    from rlf_envs.tools.base import ToolError

    def make(p: Path, names: list[str]) -> None:
        con = sqlite3.connect(p)
        con.execute("CREATE TABLE t (name TEXT)")
        con.executemany("INSERT INTO t VALUES (?)", [(n,) for n in names])
        con.commit()
        con.close()

    db, new = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    make(db, ["old"])
    make(new, ["new", "newer"])
    describe = {t.name: t for t in sql_tools()}["describe_table"]
    run = {t.name: t for t in sql_tools()}["run_query"]
    bound = Database(str(db))
    assert "old" in asyncio.run(describe.call({"table": "t"}, bound))
    assert asyncio.run(run.call({"sql": "SELECT count(*) FROM t"}, bound)) == "1"
    os.replace(new, db)  # a new database put in place between two calls
    assert asyncio.run(run.call({"sql": "SELECT count(*) FROM t"}, bound)) == "2"
    assert "newer" in asyncio.run(describe.call({"table": "t"}, bound))
    db.unlink()
    with pytest.raises(ToolError, match="not found"):
        asyncio.run(run.call({"sql": "SELECT count(*) FROM t"}, bound))


def test_remembered_tool_outputs_are_the_calls_own_and_follow_the_file(tmp_path: Path) -> None:
    """A repeated call on the same unchanged file answers from memory with the same text; a volatile query, an
    error or cache_results=False is never remembered; a changed file gets new answers;
    close_idle_connections forgets them."""
    import asyncio

    from rlf_envs.envs.sql import _OUTPUTS, Database, QueryLimits
    from rlf_envs.rewards.sql import close_idle_connections
    from rlf_envs.tools.base import ToolError

    p = tmp_path / "a.sqlite"
    con = sqlite3.connect(p)
    con.executescript("CREATE TABLE t (name TEXT); INSERT INTO t VALUES ('x'), ('y');")
    con.close()
    close_idle_connections()
    tools = {t.name: t for t in sql_tools()}
    bound = Database(str(p))

    def run(name: str, **args: Any) -> str:
        return asyncio.run(tools[name].call(args, bound))

    def remembered() -> int:
        return sum(k[1][0] == str(p) for k in _OUTPUTS._items)

    def three() -> list[str]:
        return [run("list_tables"), run("describe_table", table="t"), run("run_query", sql="SELECT count(*) FROM t")]

    first = three()
    assert three() == first
    assert first[2] == "2" and remembered() == 3
    assert len({run("run_query", sql="SELECT random()") for _ in range(5)}) == 5  # volatile: never remembered
    for _ in range(2):
        with pytest.raises(ToolError, match="no such column"):
            run("run_query", sql="SELECT nope FROM t")
        with pytest.raises(ToolError, match="no table"):
            run("describe_table", table="nope")
    assert remembered() == 3
    uncached = {t.name: t for t in sql_tools(QueryLimits(cache_results=False))}
    assert asyncio.run(uncached["run_query"].call({"sql": "SELECT count(*) FROM t"}, bound)) == "2"
    assert remembered() == 3
    con = sqlite3.connect(p)  # the file changes: the next calls answer for it
    con.execute("INSERT INTO t VALUES ('z')")
    con.commit()
    con.close()
    assert run("run_query", sql="SELECT count(*) FROM t") == "3"
    assert "z" in run("describe_table", table="t")
    close_idle_connections()
    assert remembered() == 0
