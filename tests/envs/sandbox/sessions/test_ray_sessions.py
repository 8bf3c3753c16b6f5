"""Sandbox sessions, ray backend, on a real multi-raylet Ray cluster (`ray.cluster_utils.Cluster`: several raylets on
this machine, each with a custom resource standing for its node), not mocks:

- the session protocol's behaviour (exec exit codes/stdin/cwd/env, the deadline kill, the output cap, files, diff,
  typed errors with their fields, close) is the same on `local` and on `ray` (the checks run over both);
- sessions land where the placement says (asserted from the host actors' own node ids and the session agents' real
  parent raylet, never from `ray.nodes()`), spread across hosts, respect the per-node cap (shared by an attached
  client), and the hosts' own counts free capacity no client closed;
- SIGKILL of the driver (a subprocess) leaves no session process, label, cgroup, mount or seed cache on any node;
- killing one raylet mid-batch fails only that node's sessions (SessionInfraError) while the others finish; new
  sessions go to the nodes left, and a node that joins gets a host.

Needs root (the local backend underneath) and Ray (the `ray` extra); skipped with the reason otherwise. The
node-death test runs last (it removes a node of the module's cluster).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the ray session backend needs Ray (pip install -e './rlf_envs[ray]')")

from rlf_envs import runtime  # noqa: E402
from rlf_envs.sandbox.sessions import (  # noqa: E402
    ExecResult,
    SessionBackend,
    SessionClosed,
    SessionDiffTooLarge,
    SessionError,
    SessionExpired,
    SessionInfraError,
    SessionLimitExceeded,
    SessionLimits,
    SessionSpec,
    open_backend,
)
from rlf_envs.sandbox.sessions.ray import NodeInfo, NodeSelector, RayBackend  # noqa: E402

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the local session backend (on every node) needs root")]

FAST = SessionLimits(exec_timeout_s=20, session_timeout_s=300, memory_mb=256, pids=64, disk_mb=32)
MB = 1 << 20
CAP = 4  # sessions per node of the module's backend


def go(coro: Awaitable[Any], timeout: float = 120) -> Any:
    return runtime.run(coro, timeout=timeout)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------------- the cluster


class Nodes:
    """The module's cluster: the head (the driver's node; it declares a GPU, num_gpus=1, so the default selector
    must avoid it) and the session nodes a and b."""

    def __init__(self, labels_dir: str) -> None:
        from ray.cluster_utils import Cluster

        self.labels_dir = labels_dir
        small = {"object_store_memory": 80 * MB, "num_cpus": 1}
        self.cluster = Cluster(initialize_head=True, head_node_args={
            **small, "num_gpus": 1, "include_dashboard": False, "resources": {"rlf_node_head": 1},
            # a dead raylet is noticed in ~2 s (the default is ~30 s)
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                               "health_check_initial_delay_ms": 0}})
        self.node = {"head": self.cluster.head_node}
        for name in ("a", "b"):
            self.node[name] = self.cluster.add_node(wait=False, **small, resources={
                f"rlf_node_{name}": 1, "rlf_sessions": 1}, labels={"rlf.role": "sessions"})
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, log_to_driver=False, logging_level="warning")

    def node_id(self, name: str) -> str:
        """The node's id as a task running there sees it (scheduled by the node's own resource)."""

        @ray.remote(num_cpus=0)
        def where() -> str:
            return ray.get_runtime_context().get_node_id()

        return str(ray.get(where.options(resources={f"rlf_node_{name}": 0.001}).remote(), timeout=60))

    def raylet_pid(self, name: str) -> int:
        return int(self.node[name].all_processes["raylet"][0].process.pid)

    def add(self, name: str) -> None:
        self.node[name] = self.cluster.add_node(object_store_memory=80 * MB, num_cpus=1,
                                                resources={f"rlf_node_{name}": 1, "rlf_sessions": 1})


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        ray.shutdown()
    # Ray's files in a directory of our own (a short path: its sockets live there): the cluster's address file
    # (/tmp/ray/ray_current_cluster otherwise) would make a plain `ray.init()` elsewhere on this machine connect here
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rlf-ray-", dir="/tmp")
    n = None
    try:
        n = Nodes(str(tmp_path_factory.mktemp("ray-labels")))
        yield n
    finally:
        ray.shutdown()
        if n is not None:
            n.cluster.shutdown()
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)
        if old is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old


def ray_backend(nodes: Nodes, **kw: Any) -> RayBackend:
    opts: dict[str, Any] = dict(node_selector="resource:rlf_sessions", per_node_cap=CAP,
                                host_env={"RLF_SESSIONS_DIR": nodes.labels_dir}, health_every_s=1.0,
                                discover_every_s=1.0, host_cooldown_s=1.0, inner_kwargs={"pool_size": 0})
    opts.update(kw)
    return RayBackend(**opts)


@pytest.fixture(scope="module")
def rb(nodes: Nodes) -> Iterator[RayBackend]:
    b = ray_backend(nodes)
    try:
        yield b
    finally:
        go(b.aclose())


@pytest.fixture(scope="module")
def lb() -> Iterator[SessionBackend]:
    from rlf_envs.sandbox.sessions.local import LocalBackend

    b = LocalBackend(pool_size=0)
    try:
        yield b
    finally:
        go(b.aclose())


@pytest.fixture(params=["local", "ray"])
def backend(request: pytest.FixtureRequest) -> SessionBackend:
    return request.getfixturevalue("lb" if request.param == "local" else "rb")  # type: ignore[no-any-return]


@pytest.fixture()
def seed(tmp_path: Path) -> Path:
    d = tmp_path / "seed"
    (d / "pkg").mkdir(parents=True)
    (d / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (d / "README").write_text("hello\n")
    (d / "gone.txt").write_text("bye\n")
    (d / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (d / "run.sh").write_text("#!/bin/sh\necho run\n")
    (d / "run.sh").chmod(0o755)
    (d / "link").symlink_to("README")
    return d


# --------------------------------------------------------------------------------------------------- the protocol


def test_exec_exit_codes_stdin_cwd_env_and_state(backend: SessionBackend, seed: Path) -> None:
    async def t() -> None:
        async with await backend.create(SessionSpec(seed_dir=str(seed), limits=FAST, env={"FOO": "bar"})) as s:
            r = await s.exec("echo $FOO; pwd; cat README; exit 3")
            assert type(r) is ExecResult
            assert (r.exit_code, r.stdout, r.timed_out) == (3, "bar\n/workspace\nhello\n", False), r
            r = await s.exec(["cat"], stdin=b"from stdin")
            assert r.stdout == "from stdin" and r.exit_code == 0
            r = await s.exec(["pwd"], cwd="/workspace/pkg", env={"X": "1"})
            assert r.stdout == "/workspace/pkg\n"
            r = await s.exec("echo err >&2; kill -9 $$")
            assert r.stderr == "err\n" and r.exit_code == 128 + 9 and not r.timed_out
            r = await s.exec(["no-such-program-xyz"])
            assert r.exit_code == 127 and "no-such-program-xyz" in r.stderr
            await s.exec("echo kept > state.txt && export GONE=1")
            r = await s.exec("cat state.txt; echo ${GONE:-unset}; ./run.sh; readlink link")
            assert r.stdout == "kept\nunset\nrun\nREADME\n", r  # the seed's modes and links arrived as they are
            r = await s.exec("id -u")
            assert r.stdout.split() == [str(s.uid)] and s.uid not in (0, None)  # type: ignore[attr-defined]
            with pytest.raises(ValueError):
                await s.exec(123)  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                await s.exec("true", timeout_s=0)
            with pytest.raises(SessionError):
                await s.exec("true", cwd="a\0b")

    go(t())


def test_deadline_kills_everything_the_call_started(backend: SessionBackend) -> None:
    async def t() -> None:
        async with await backend.create(SessionSpec(limits=FAST)) as s:
            await s.exec("sleep 1000 > /dev/null 2>&1 &")  # a background process of an earlier call survives it
            t0 = time.monotonic()
            r = await s.exec("setsid sh -c 'sleep 1000 & sleep 1000' & trap '' TERM; sleep 1000", timeout_s=1.0)
            assert r.timed_out and r.exit_code == 124, r
            assert time.monotonic() - t0 < 30  # generous: the deadline fired, the box may be loaded
            ps = await s.exec(["sh", "-c", "for p in /proc/[0-9]*; do cat $p/cmdline | tr '\\0' ' '; echo; done"])
            assert len([x for x in ps.stdout.splitlines() if x.startswith("sleep 1000")]) == 1, ps.stdout

    go(t())


def test_output_cap_files_and_typed_errors(backend: SessionBackend, seed: Path) -> None:
    lim = SessionLimits(output_bytes=1000, exec_timeout_s=20, disk_mb=32, memory_mb=256)

    async def t() -> None:
        async with await backend.create(SessionSpec(seed_dir=str(seed), limits=lim)) as s:
            r = await s.exec("head -c 5000000 /dev/zero | tr '\\0' x; echo tail >&2")
            assert r.truncated and len(r.stdout) == 1000 and r.stderr == "tail\n" and r.exit_code == 0
            await s.write_file("new/dir/x.py", "print('hi')\n")
            assert await s.read_file("new/dir/x.py") == b"print('hi')\n"
            await s.write_file("/workspace/b.bin", b"\x00\xff" * 10, mode=0o600)
            assert await s.read_file("b.bin") == b"\x00\xff" * 10
            with pytest.raises(FileNotFoundError):
                await s.read_file("nope.txt")
            await s.exec("mkfifo fifo")
            with pytest.raises(SessionError, match="not a regular file"):
                await s.read_file("fifo")
            with pytest.raises(SessionError):
                await s.write_file("/usr/evil", "x")
            with pytest.raises(SessionError):
                await s.write_file("m.txt", "x", mode=0o10000)
            with pytest.raises(SessionDiffTooLarge) as e:  # the field of the error travels with it
                await s.diff(max_bytes=10)
            assert e.value.limit == "diff_bytes" and isinstance(e.value, SessionLimitExceeded)

    go(t())


def test_diff_is_a_git_patch_that_reproduces_the_workspace(backend: SessionBackend, seed: Path,
                                                           tmp_path: Path) -> None:
    async def t() -> str:
        async with await backend.create(SessionSpec(seed_dir=str(seed), limits=FAST)) as s:
            assert await s.diff() == ""
            await s.exec("printf 'def f():\\n    return 2\\n' > pkg/mod.py && rm gone.txt && echo hi > new.txt"
                         " && printf '\\x00\\x01\\x02' > blob.bin && chmod +x README")
            return str(await s.diff())

    patch = go(t())
    assert "diff --git a/pkg/mod.py b/pkg/mod.py" in patch and "deleted file mode 100644" in patch
    assert "GIT binary patch" in patch and "new mode 100755" in patch
    if shutil.which("git") is None:
        return
    work = tmp_path / "apply"
    shutil.copytree(seed, work, symlinks=True)
    (tmp_path / "p.diff").write_text(patch)
    subprocess.run(["git", "apply", "--binary", str(tmp_path / "p.diff")], cwd=work, check=True, timeout=60)
    assert (work / "pkg" / "mod.py").read_text() == "def f():\n    return 2\n"
    assert not (work / "gone.txt").exists() and (work / "new.txt").read_text() == "hi\n"


def test_close_is_idempotent_and_the_wall_clock_ends_a_session(backend: SessionBackend) -> None:
    async def t() -> None:
        s = await backend.create(SessionSpec(limits=FAST))
        await s.aclose()
        await s.aclose()
        await s.close()
        with pytest.raises(SessionClosed):
            await s.exec("true")
        s = await backend.create(SessionSpec(limits=SessionLimits(session_timeout_s=2, exec_timeout_s=30)))
        r = await s.exec("sleep 10")  # cut to what the session has left
        assert r.timed_out
        await asyncio.sleep(2.0)
        with pytest.raises(SessionExpired, match="wall clock"):
            await s.exec("true")
        await s.aclose()

    go(t())


def _agent_pid(s: Any) -> int:
    """pid 1 of the session's namespace (the agent C), from the session's owner label on its node."""
    lab = getattr(getattr(s, "_agent", None), "label", None)
    if lab is not None:
        return int(lab.procs[0][0])
    d = s._backend.host_env["RLF_SESSIONS_DIR"]
    with open(os.path.join(d, f"{s.id}.json")) as f:
        return int(json.load(f)["procs"][0][0])


def test_a_session_killed_from_outside_is_an_infra_error(backend: SessionBackend) -> None:
    async def t() -> None:
        async with await backend.create(SessionSpec(limits=FAST)) as s:
            assert (await s.exec("echo ok")).ok
            os.kill(_agent_pid(s), signal.SIGKILL)
            with pytest.raises(SessionInfraError):
                await s.exec("true")
        async with await backend.create(SessionSpec(limits=FAST)) as s:  # the backend goes on
            assert (await s.exec("echo ok")).stdout == "ok\n"

    go(t())


# --------------------------------------------------------------------------------------------------- placement


def _label(nodes: Nodes, sid: str) -> dict[str, Any]:
    with open(os.path.join(nodes.labels_dir, f"{sid}.json")) as f:
        return json.load(f)  # type: ignore[no-any-return]


def _ancestors(pid: int) -> list[int]:
    import psutil

    out = []
    try:
        p: Any = psutil.Process(pid)
        while p is not None and p.pid > 1:
            p = p.parent()
            if p is not None:
                out.append(p.pid)
    except psutil.Error:
        pass
    return out


def test_sessions_land_where_placement_says_spread_and_respect_the_cap(nodes: Nodes, rb: RayBackend) -> None:
    want = {name: nodes.node_id(name) for name in ("a", "b")}
    host_nodes = {h.node_id for h in rb.hosts() if h.state == "up"}
    assert host_nodes == set(want.values())  # resource:rlf_sessions: a and b, not the head

    async def t() -> None:
        ss = await asyncio.gather(*(rb.create(SessionSpec(limits=FAST)) for _ in range(2 * CAP)))
        try:
            per = {name: [s for s in ss if s.node_id == nid] for name, nid in want.items()}  # type: ignore[attr-defined]
            assert {k: len(v) for k, v in per.items()} == {"a": CAP, "b": CAP}  # spread, each host at its cap
            for name, group in per.items():
                raylet = nodes.raylet_pid(name)
                for s in group:
                    agent = _label(nodes, s.id)["procs"][1][0]  # the session's agent process, as its label says
                    assert raylet in _ancestors(agent), (name, s.id)  # it runs under that node's raylet
            # every host is at its cap: a create waits (it is not put over the cap anywhere) ...
            waiting = asyncio.ensure_future(rb.create(SessionSpec(limits=FAST)))
            # ... and so does one of an attached client: the hosts count the sessions of every client
            other = RayBackend(attach=rb.group, create_timeout_s=2.0, health_every_s=1.0)
            assert {h.node_id for h in other.hosts()} == set(want.values())
            with pytest.raises(SessionInfraError, match="no session host had room"):
                await other.create(SessionSpec(limits=FAST))
            await asyncio.sleep(1.0)
            assert not waiting.done()
            freed = per["b"][0]
            await freed.aclose()
            s = await asyncio.wait_for(waiting, 60)
            assert s.node_id == want["b"]  # type: ignore[attr-defined]
            ss.append(s)
            await other.aclose()
        finally:
            await asyncio.gather(*(s.aclose() for s in ss))
        assert all(h.sessions == 0 for h in rb.hosts())

    go(t(), timeout=180)


def test_capacity_a_host_frees_itself_is_counted(nodes: Nodes, rb: RayBackend) -> None:
    """A session past its wall clock is closed by its host; the load the client sees comes from the host's count,
    so the slot is free again although no client closed it (and a late call gets SessionExpired)."""

    async def t() -> None:
        s = await rb.create(SessionSpec(limits=SessionLimits(session_timeout_s=1, exec_timeout_s=5)))
        h = s._host  # type: ignore[attr-defined]
        assert h.n >= 1
        deadline = time.monotonic() + 60
        while h.n > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
        assert h.n == 0, rb.hosts()
        with pytest.raises(SessionExpired):
            await s.exec("true")
        await s.aclose()

    go(t())


def test_node_selection(nodes: Nodes) -> None:
    real = [NodeInfo.from_ray(d) for d in ray.nodes()]
    ids = {name: nodes.node_id(name) for name in ("head", "a", "b")}
    chosen = {n.node_id for n in NodeSelector().select(real)}
    assert chosen == {ids["a"], ids["b"]}  # the default: the nodes without GPUs when there are any
    assert {n.node_id for n in NodeSelector.parse("rlf.role=sessions").select(real)} == {ids["a"], ids["b"]}
    assert {n.node_id for n in NodeSelector.parse("gpus:allow").select(real)} == set(ids.values())
    assert {n.node_id for n in NodeSelector.parse("resource:rlf_node_head").select(real)} == {ids["head"]}
    assert NodeSelector.parse("resource:rlf_node_head,gpus:exclude").select(real) == []
    gpu_only = [n for n in real if n.gpus]
    assert NodeSelector().select(gpu_only) == gpu_only  # GPUs everywhere: they are used
    with pytest.raises(ValueError, match="node selector term"):
        NodeSelector.parse("bogus")
    with pytest.raises(ValueError, match="gpus"):
        NodeSelector.parse("gpus:sometimes")
    with pytest.raises(SessionInfraError, match="no Ray node matches"):
        open_backend("ray", node_selector="resource:no_such_resource")


def test_a_host_that_cannot_start_is_refused_when_the_backend_opens(nodes: Nodes) -> None:
    with pytest.raises(SessionInfraError, match="no session host started on the 2 selected node.*no docker engine"):
        ray_backend(nodes, inner="docker", inner_kwargs={"base_url": "unix:///nonexistent/docker.sock"})


def test_a_client_its_hosts_stop_hearing_from_loses_only_its_sessions(nodes: Nodes, rb: RayBackend) -> None:
    """A client that goes silent (died without closing, cut off) has its sessions closed by the hosts once its
    lease runs out; the sessions of the others go on."""

    async def t() -> None:
        mine = await rb.create(SessionSpec(limits=FAST))
        quiet = RayBackend(attach=rb.group, lease_s=2.0, health_every_s=1000.0)  # pings once, then never
        s = await quiet.create(SessionSpec(limits=FAST))
        h = next(x for x in rb._hosts.values() if x.node_id == s.node_id)  # type: ignore[attr-defined]

        async def live() -> int:  # the host's count, asked without a client (so no lease is renewed)
            return int((await rb._ask(h, h.actor.stats.remote(), 10, "stats"))[1]["live"])

        before = await live()
        deadline = time.monotonic() + 60
        while await live() == before and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert await live() == before - 1
        with pytest.raises(SessionInfraError, match="its client was silent"):
            await s.exec("true")
        assert (await mine.exec("echo ok")).stdout == "ok\n"
        await s.aclose()
        await quiet.aclose()
        await mine.aclose()

    go(t())


def test_swe_env_on_the_ray_backend(nodes: Nodes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gym.make("rlf/SWE-v0", backend="ray")`: the episode's workspace and its hidden-test run are sessions on the
    cluster's session nodes (the backend configured by environment variables, as a launcher would)."""
    import gymnasium as gym

    from rlf_envs.envs.swe import env as swe_env
    from rlf_envs.sandbox.sessions.images import debian_test_image
    from tests.envs.envs.swe.test_swe_env import call, run_episode, tiny_row

    if debian_test_image() is None:
        pytest.skip("no session image with pytest: run `python -m rlf_envs.sandbox.sessions.images build-debian`")
    monkeypatch.setenv("RLF_RAY_SESSION_NODES", "rlf.role=sessions")
    monkeypatch.setenv("RLF_RAY_SESSIONS_PER_NODE", "4")
    env = gym.make("rlf/SWE-v0", tasks=[tiny_row(tmp_path)], backend="ray",
                   limits={"exec_timeout_s": 20.0, "output_chars": 600}).unwrapped
    shared = swe_env._BACKENDS["ray"]
    try:
        assert isinstance(shared, RayBackend)
        assert {h.node_id for h in shared.hosts()} == {nodes.node_id("a"), nodes.node_id("b")}
        r, info, _ = run_episode(env, [call("edit", path="calc/__init__.py", old="if x < hi:", new="if x > hi:"),
                                       call("submit")])
        assert r == 1.0 and info["infra_failed"] is False
        assert shared.counters["creates"] >= 2  # the agent's workspace and the fresh copy the hidden tests ran in
    finally:
        env.close()
        with swe_env._LOCK:
            swe_env._BACKENDS.pop("ray", None)
        runtime.unregister_closer(shared)
        go(shared.aclose())


# --------------------------------------------------------------------------------------------------- no leftovers


DRIVER = textwrap.dedent("""
    import asyncio, json, sys
    import ray
    from rlf_envs.sandbox.sessions import SessionLimits, SessionSpec
    from rlf_envs.sandbox.sessions.ray import RayBackend
    ray.init(address=sys.argv[1], log_to_driver=False, logging_level="warning")
    b = RayBackend(node_selector="resource:rlf_sessions", per_node_cap=8,
                   host_env={"RLF_SESSIONS_DIR": sys.argv[2]}, inner_kwargs={"pool_size": 2})
    async def main():
        lim = SessionLimits(exec_timeout_s=60, disk_mb=16, memory_mb=128, pids=32)
        ss = await asyncio.gather(*(b.create(SessionSpec(limits=lim, seed_dir=sys.argv[3])) for _ in range(8)))
        await asyncio.gather(*(s.exec("sleep 1000 > /dev/null 2>&1 & setsid sleep 1000 > /dev/null 2>&1 &")
                               for s in ss))
        print(json.dumps({"sessions": [[s.id, s.uid, s.node_id] for s in ss],
                          "hosts": [[h.node_id, h.pid] for h in b.hosts()]}), flush=True)
        await asyncio.sleep(1000)
    asyncio.run(main())
""")


def _procs_of_uid(uid: int) -> list[int]:
    out = []
    for n in os.listdir("/proc"):
        if n.isdigit():
            try:
                if os.stat(f"/proc/{n}").st_uid == uid:
                    with open(f"/proc/{n}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                            out.append(int(n))
            except OSError:
                pass
    return out


def test_sigkill_of_the_driver_leaves_nothing_on_any_node(nodes: Nodes, seed: Path, tmp_path: Path) -> None:
    labels = tmp_path / "labels"
    labels.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    p = subprocess.Popen([sys.executable, "-c", DRIVER, nodes.cluster.address, str(labels), str(seed)], env=env,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("{"), line
        got = json.loads(line)
        assert len({nid for _, _, nid in got["sessions"]}) == 2  # on both session nodes
        labs = [json.loads(f.read_text()) for f in labels.glob("*.json")]
        assert len(labs) >= 8  # the sessions (and the warm pools' agents)
        cgroups = [d for lab in labs for d in lab["cgroups"]]
        host_pids = [pid for _, pid in got["hosts"]]
        seed_base = Path(os.environ.get("RLF_CACHE_DIR") or Path.home() / ".cache" / "rlf") / "ray-seeds"
        assert any(d.name.split("-")[0] in map(str, host_pids) for d in seed_base.iterdir())
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        deadline = time.monotonic() + 90

        def left() -> list[str]:
            out = [f"host pid {pid}" for pid in host_pids if _alive(pid)]
            out += [f"uid {uid}: {_procs_of_uid(uid)}" for _, uid, _ in got["sessions"] if _procs_of_uid(uid)]
            out += [f"label {f.name}" for f in labels.glob("*.json")]
            out += [f"cgroup {d}" for d in cgroups if os.path.isdir(d)]
            out += [f"seed cache {d}" for d in seed_base.glob("*") if d.name.split("-")[0] in map(str, host_pids)]
            with open("/proc/self/mountinfo") as f:
                out += [f"mount {m.split()[4]}" for m in f if str(labels) in m]
            return out

        while left() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert left() == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        if p.stdout is not None:
            p.stdout.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --------------------------------------------------------------------------------------------------- node death


def test_a_dead_node_fails_only_its_sessions_and_a_new_node_gets_a_host(nodes: Nodes, rb: RayBackend) -> None:
    """Runs last: it removes node b from the module's cluster."""
    a, b = nodes.node_id("a"), nodes.node_id("b")

    async def episode(s: Any) -> str:
        for _ in range(8):
            r = await s.exec("sleep 0.5; echo ok")
            assert r.stdout == "ok\n"
        return "ok"

    async def t() -> None:
        ss = await asyncio.gather(*(rb.create(SessionSpec(limits=FAST)) for _ in range(2 * CAP)))
        on_b = [s for s in ss if s.node_id == b]  # type: ignore[attr-defined]
        assert len(on_b) == CAP
        b_labels = [s.id for s in on_b]
        batch = asyncio.gather(*(episode(s) for s in ss), return_exceptions=True)
        await asyncio.sleep(1.5)
        await asyncio.to_thread(nodes.cluster.remove_node, nodes.node["b"], False)
        outcomes = await asyncio.wait_for(batch, 120)
        for s, out in zip(ss, outcomes, strict=True):
            if s.node_id == a:  # type: ignore[attr-defined]
                assert out == "ok", (out, rb.hosts())  # the other node's episodes finished and scored
            else:
                assert isinstance(out, SessionInfraError), out  # an infrastructure failure, not the policy's
        with pytest.raises(SessionInfraError):
            await on_b[0].exec("true")  # and stays one
        await asyncio.gather(*(s.aclose() for s in ss))
        deadline = time.monotonic() + 30
        while any(h.node_id == b and h.state == "up" for h in rb.hosts()) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert [h.state for h in rb.hosts() if h.node_id == b] in (["cooldown"], ["starting"], ["gone"]), rb.hosts()
        assert rb.counters["sessions_lost"] >= CAP, rb.counters
        # the dead node's sessions left nothing (its host's watchdog reaped them)
        deadline = time.monotonic() + 60
        while any(os.path.exists(os.path.join(nodes.labels_dir, f"{sid}.json")) for sid in b_labels) \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert not [sid for sid in b_labels if os.path.exists(os.path.join(nodes.labels_dir, f"{sid}.json"))]
        # new sessions go to the node left, within its cap
        more = await asyncio.gather(*(rb.create(SessionSpec(limits=FAST)) for _ in range(CAP)))
        assert {s.node_id for s in more} == {a}, rb.hosts()  # type: ignore[attr-defined]
        await asyncio.gather(*(s.aclose() for s in more))

    go(t(), timeout=300)
    nodes.add("c")  # a node that joins the cluster gets a host, and sessions (Ray starts nodes from the main thread)
    c = nodes.node_id("c")

    async def joined() -> None:
        deadline = time.monotonic() + 90
        while not any(h.node_id == c and h.state == "up" for h in rb.hosts()) and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert any(h.node_id == c and h.state == "up" for h in rb.hosts()), rb.hosts()
        more = await asyncio.gather(*(rb.create(SessionSpec(limits=FAST)) for _ in range(2 * CAP)))
        assert sorted(s.node_id for s in more) == sorted([a] * CAP + [c] * CAP), rb.hosts()  # type: ignore[attr-defined]
        outs = await asyncio.gather(*(s.exec("echo ok") for s in more))
        assert [r.stdout for r in outs] == ["ok\n"] * len(more)
        await asyncio.gather(*(s.aclose() for s in more))

    go(joined(), timeout=300)
