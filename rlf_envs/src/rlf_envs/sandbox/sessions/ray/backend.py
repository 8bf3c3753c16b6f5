"""The client side of the ray session backend: `RayBackend` places sessions on host actors across a Ray cluster and
`RaySession` forwards each call to its host. See the package docstring and docs/guides/coding-agent-cluster.md."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import os
import random
import tarfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rlf_envs.sandbox.sessions import owners
from rlf_envs.sandbox.sessions.ray.wire import HostConfig, Reply, decode_error
from rlf_envs.sandbox.sessions.types import (
    ExecResult,
    Session,
    SessionBackend,
    SessionClosed,
    SessionError,
    SessionInfraError,
    SessionSpec,
)

log = logging.getLogger(__name__)

#: the Ray namespace of every host actor (named "<group>:<node id>")
NAMESPACE = "rlf-sessions"
GPU_RULES = ("avoid", "allow", "exclude")
#: seconds a call may take beyond its own deadline (the backend underneath allows 30 s more itself) before the host
#: counts as lost for it
CALL_GRACE_S = 60.0
PING_TIMEOUT_S = 10.0


# ---------------------------------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class NodeInfo:
    """A node of the cluster as `ray.nodes()` describes it."""

    node_id: str
    alive: bool
    hostname: str = ""
    address: str = ""
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def cpus(self) -> float:
        return float(self.resources.get("CPU", 0))

    @property
    def gpus(self) -> float:
        return float(self.resources.get("GPU", 0))

    @classmethod
    def from_ray(cls, d: dict[str, Any]) -> NodeInfo:
        return cls(node_id=str(d.get("NodeID", "")), alive=bool(d.get("Alive")),
                   hostname=str(d.get("NodeManagerHostname", "")), address=str(d.get("NodeManagerAddress", "")),
                   resources={str(k): float(v) for k, v in (d.get("Resources") or {}).items()},
                   labels={str(k): str(v) for k, v in (d.get("Labels") or {}).items()})


@dataclass(frozen=True)
class NodeSelector:
    """Which nodes of the cluster host sessions. A node is chosen when it is alive, carries every label in `labels`
    (Ray node labels: `ray start --labels='{"rlf.sessions": "1"}'`), and offers the custom resource `resource` when
    one is named (`ray start --resources='{"rlf_sessions": 1}'`). `gpus`: "avoid" (the default: of the matching
    nodes, only those without GPUs when there is any, so sandboxes stay off the nodes that generate and train),
    "exclude" (never a node with GPUs) or "allow".

    As a string (RLF_RAY_SESSION_NODES, a config value): comma-separated terms `resource:NAME`, `KEY=VALUE` (a label)
    and `gpus:avoid|allow|exclude`; "" or "default" is the default."""

    labels: dict[str, str] = field(default_factory=dict)
    resource: str | None = None
    gpus: str = "avoid"

    def __post_init__(self) -> None:
        if self.gpus not in GPU_RULES:
            raise ValueError(f"NodeSelector.gpus must be one of {', '.join(GPU_RULES)}, got {self.gpus!r}")
        if self.resource is not None and (not isinstance(self.resource, str) or not self.resource):
            raise ValueError(f"NodeSelector.resource must be a resource name, got {self.resource!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.labels.items()):
            raise ValueError("NodeSelector.labels must map str to str")

    @classmethod
    def parse(cls, v: NodeSelector | dict[str, Any] | str | None) -> NodeSelector:
        if v is None:
            return cls()
        if isinstance(v, NodeSelector):
            return v
        if isinstance(v, dict):
            unknown = set(v) - {"labels", "resource", "gpus"}
            if unknown:
                raise ValueError(f"unknown node selector keys {sorted(unknown)} (use labels, resource, gpus)")
            return cls(labels=dict(v.get("labels") or {}), resource=v.get("resource"), gpus=v.get("gpus", "avoid"))
        if not isinstance(v, str):
            raise TypeError(f"a node selector is a NodeSelector, a dict or a string, got {type(v).__name__}")
        labels: dict[str, str] = {}
        resource, gpus = None, "avoid"
        for term in (t.strip() for t in v.split(",")):
            if not term or term == "default":
                continue
            if term.startswith("resource:"):
                resource = term.split(":", 1)[1].strip()
            elif term.startswith("gpus:"):
                gpus = term.split(":", 1)[1].strip()
            elif "=" in term:
                k, _, val = term.partition("=")
                labels[k.strip()] = val.strip()
            else:
                raise ValueError(f"node selector term {term!r}: use resource:NAME, KEY=VALUE (a node label) or "
                                 "gpus:avoid|allow|exclude")
        return cls(labels=labels, resource=resource, gpus=gpus)

    def matches(self, n: NodeInfo) -> bool:
        return (n.alive and all(n.labels.get(k) == v for k, v in self.labels.items())
                and (self.resource is None or n.resources.get(self.resource, 0) > 0)
                and not (self.gpus == "exclude" and n.gpus > 0))

    def select(self, nodes: list[NodeInfo]) -> list[NodeInfo]:
        m = [n for n in nodes if self.matches(n)]
        if self.gpus == "avoid":
            m = [n for n in m if n.gpus == 0] or m
        return m

    def describe(self) -> str:
        terms = [f"resource:{self.resource}"] if self.resource else []
        terms += [f"{k}={v}" for k, v in sorted(self.labels.items())]
        return ",".join([*terms, f"gpus:{self.gpus}"])


# ---------------------------------------------------------------------------------------------------- hosts


@dataclass
class HostInfo:
    """What `RayBackend.hosts()` reports of one host (a snapshot)."""

    node_id: str
    hostname: str
    state: str  # "starting" | "up" | "cooldown" (down, to be started again) | "gone" (its node left)
    cap: int
    load: int  # sessions live, starting and closing on the host (all its clients), as it last said, + our creates
    sessions: int  # this backend's open sessions there
    failures: int
    last_error: str | None
    pid: int | None


class _Host:
    def __init__(self, node: NodeInfo, name: str, cap: int) -> None:
        self.node = node
        self.node_id = node.node_id
        self.name = name
        self.cap = cap
        self.actor: Any = None
        self.state = "starting"
        self.n = 0  # the host's own count of its load, from its last reply
        self.inflight = 0  # our creates sent to it and not answered yet
        self.pending: set[str] = set()  # their request ids
        self.sessions: dict[str, RaySession] = {}
        self.failures = 0
        self.create_errors = 0  # consecutive infrastructure failures of creates there
        self.missed = 0  # consecutive pings without an answer
        self.cooldown_until = 0.0
        self.paused_until = 0.0  # no new sessions before then (creates kept failing there); its sessions go on
        self.last_error: str | None = None
        self.pid: int | None = None
        self.hostname = node.hostname

    @property
    def where(self) -> str:
        return f"node {self.node_id[:12]} ({self.hostname or self.node.address})"

    def load(self) -> int:
        return self.n + self.inflight

    def info(self) -> HostInfo:
        return HostInfo(self.node_id, self.hostname, self.state, self.cap, self.load(), len(self.sessions),
                        self.failures, self.last_error, self.pid)


def _pack(path: str) -> bytes:
    """The seed directory as an uncompressed tar (links kept as links), its entries relative to the directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(os.listdir(path)):
            tar.add(os.path.join(path, name), arcname=name, recursive=True)
    return buf.getvalue()


_ACTOR_CLASS: Any = None


def _actor_class() -> Any:
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray

        from rlf_envs.sandbox.sessions.ray.host import SessionHost

        _ACTOR_CLASS = ray.remote(SessionHost)
    return _ACTOR_CLASS


def _env_float(name: str) -> float | None:
    v = os.environ.get(name)
    if v in (None, ""):
        return None
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not a number") from None


# ---------------------------------------------------------------------------------------------------- sessions


class RaySession(Session):
    """A session on a host actor: every call is forwarded, with a deadline at this side, and answers (or raises)
    exactly as the backend underneath does. `node_id`: the Ray node it runs on; `uid`: its user id there (local)."""

    def __init__(self, backend: RayBackend, host: _Host, rid: str, info: dict[str, Any], spec: SessionSpec) -> None:
        self.id = str(info["id"])
        self.spec = spec
        self.uid = info.get("uid")
        self.node_id = host.node_id
        self.rid = rid
        self._backend = backend
        self._host = host
        self._lock = asyncio.Lock()
        self._closed = False
        self._lost: str | None = None

    def _check(self) -> None:
        if self._closed:
            raise SessionClosed(f"session {self.id} is closed")
        if self._lost is not None:
            raise SessionInfraError(self._lost)

    async def _call(self, op: str, wait_s: float, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        async with self._lock:
            self._check()
            h = self._host
            if h.actor is None:
                raise SessionInfraError(f"session {self.id}: its host on {h.where} is gone")
            try:
                ref = h.actor.call.remote(self._backend.client_id, self.rid, op, args, kwargs or {})
            except Exception as e:
                raise SessionError(f"{op}: the arguments could not be sent to the session host: {e}") from None
            try:
                reply = await self._backend._ask(h, ref, wait_s, op)
            except SessionInfraError as e:
                if self._lost is not None:  # its host failed meanwhile
                    raise SessionInfraError(self._lost) from None
                # the call's outcome is unknown: the session is done for (as the backend underneath kills a session
                # whose agent stops answering); it is closed on its host
                self._lost = f"session {self.id}: {e}"
                self._backend._forget(self)
                raise SessionInfraError(self._lost) from None
        if reply[0] == "ok":
            return reply[1]
        raise decode_error(reply[1], reply[2], reply[3], h.where)

    async def exec(self, cmd: str | list[str], *, stdin: str | bytes | None = None, timeout_s: float | None = None,
                   cwd: str | None = None, env: dict[str, str] | None = None) -> ExecResult:
        if not (isinstance(cmd, str) or (isinstance(cmd, list) and cmd and all(isinstance(a, str) for a in cmd))):
            raise ValueError("exec takes a shell command (str) or a non-empty argv (list of str)")
        t = self.spec.limits.exec_timeout_s if timeout_s is None else timeout_s
        try:
            wait = min(float(t), self.spec.limits.session_timeout_s)
        except (TypeError, ValueError):
            wait = self.spec.limits.exec_timeout_s  # the host refuses it, as the backend underneath does
        return await self._call("exec", max(0.0, wait) + CALL_GRACE_S, (cmd,),
                                {"stdin": stdin, "timeout_s": timeout_s, "cwd": cwd, "env": env})

    async def read_file(self, path: str) -> bytes:
        return await self._call("read_file", 60.0 + CALL_GRACE_S, (path,))

    async def write_file(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        n = len(data) if isinstance(data, (str, bytes, bytearray)) else 0
        await self._call("write_file", 60.0 + CALL_GRACE_S + n / (4 << 20), (path, data, mode))

    async def diff(self, max_bytes: int | None = None) -> str:
        return await self._call("diff", 30.0 + self.spec.limits.exec_timeout_s + CALL_GRACE_S, (max_bytes,))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        h = self._host
        h.sessions.pop(self.rid, None)
        if self._lost is not None or h.actor is None:
            return
        try:
            reply = await self._backend._ask(h, h.actor.close.remote(self._backend.client_id, self.rid), 60.0,
                                             "close")
            h.n = int(reply[1])
        except Exception:  # left to the host: the next ping names it as ours, and it is closed then
            pass
        finally:
            self._backend._room.set()


# ---------------------------------------------------------------------------------------------------- backend


class RayBackend(SessionBackend):
    """Sessions across a Ray cluster: one host actor per session node, each running the `inner` backend ("local"
    or "docker") there. See docs/guides/coding-agent-cluster.md.

    address: the cluster (`ray.init(address=...)`), default RLF_RAY_ADDRESS, else "auto" (the running cluster: `ray
    start --head` first); "local" starts a one-machine cluster in this process. Unused when Ray is initialised.
    node_selector: which nodes host sessions (`NodeSelector`, its dict or string; default RLF_RAY_SESSION_NODES, else
    the nodes without GPUs when there are any). per_node_cap: sessions a host holds at once (default
    RLF_RAY_SESSIONS_PER_NODE, else `sessions_per_cpu` x the node's CPUs). creates_per_node_s: each host's create
    rate (a token bucket). attach: the group of an existing backend's hosts to use instead of starting hosts (default
    RLF_RAY_SESSIONS_GROUP): caps, rates and the hosts' lifetime are then the owner's; this side only places and
    closes its own sessions. ship_seeds: send each seed directory to the session nodes (False: the path is on every
    node already, a shared filesystem). host_env: environment variables of the host actors (RLF_SESSIONS_DIR...).
    """

    name = "ray"

    def __init__(self, address: str | None = None, *, node_selector: NodeSelector | dict[str, Any] | str | None = None,
                 per_node_cap: int | None = None, sessions_per_cpu: float = 1.0, creates_per_node_s: float = 10.0,
                 inner: str | None = None, inner_kwargs: dict[str, Any] | None = None, attach: str | None = None,
                 group: str | None = None, ship_seeds: bool = True, host_env: dict[str, str] | None = None,
                 runtime_env: dict[str, Any] | None = None, create_timeout_s: float = 600.0,
                 health_every_s: float = 5.0, discover_every_s: float = 10.0, host_cooldown_s: float = 30.0,
                 lease_s: float = 120.0, start_timeout_s: float = 180.0, seed_cache_mb: int = 2048,
                 host_seed_cache_mb: int = 4096, init_kwargs: dict[str, Any] | None = None) -> None:
        try:
            import ray
        except ImportError:
            from rlf_envs.extras import pip_install

            raise SessionInfraError(f"the ray session backend needs Ray: {pip_install('ray')}") from None
        self._ray = ray
        self.address = address or os.environ.get("RLF_RAY_ADDRESS") or "auto"
        self.selector = NodeSelector.parse(node_selector if node_selector is not None
                                           else os.environ.get("RLF_RAY_SESSION_NODES"))
        cap_env = _env_float("RLF_RAY_SESSIONS_PER_NODE")
        self.per_node_cap = per_node_cap if per_node_cap is not None else (int(cap_env) if cap_env else None)
        if self.per_node_cap is not None and (not isinstance(self.per_node_cap, int) or self.per_node_cap <= 0):
            raise ValueError(f"per_node_cap must be a positive int, got {self.per_node_cap!r}")
        if not sessions_per_cpu > 0:
            raise ValueError(f"sessions_per_cpu must be positive, got {sessions_per_cpu!r}")
        self.sessions_per_cpu = float(sessions_per_cpu)
        self.inner = inner or os.environ.get("RLF_RAY_SESSION_INNER") or "local"
        if self.inner not in ("local", "docker"):
            raise ValueError(f"inner must be 'local' or 'docker', got {self.inner!r}")
        self.inner_kwargs = dict(inner_kwargs or {})
        self.creates_per_node_s = float(creates_per_node_s)
        self.attach = attach if attach is not None else (os.environ.get("RLF_RAY_SESSIONS_GROUP") or None)
        self.group = self.attach or group or f"{owners.RUN_ID}-{uuid.uuid4().hex[:6]}"
        self.owner = self.attach is None
        self.ship_seeds = ship_seeds
        self.host_env = dict(host_env or {})
        self.runtime_env = runtime_env
        self.create_timeout_s = float(create_timeout_s)
        self.health_every_s = float(health_every_s)
        self.discover_every_s = float(discover_every_s)
        self.host_cooldown_s = float(host_cooldown_s)
        self.lease_s = float(lease_s)
        self.start_timeout_s = float(start_timeout_s)
        self.seed_cache_bytes = int(seed_cache_mb) << 20
        self.host_seed_cache_mb = int(host_seed_cache_mb)
        self.client_id = f"{owners.RUN_ID}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        #: counters: creates, create_retries, host_failures, sessions_lost (to their host's failure or a call it did
        #: not answer), hosts_started
        self.counters: dict[str, int] = {"creates": 0, "create_retries": 0, "host_failures": 0, "sessions_lost": 0,
                                         "hosts_started": 0}
        self._hosts: dict[str, _Host] = {}
        self._nodes: dict[str, NodeInfo] = {}
        self._seeds: OrderedDict[tuple[Any, ...], asyncio.Task[tuple[str, Any, int]]] = OrderedDict()
        self._seed_sizes: dict[tuple[Any, ...], int] = {}
        self._task: asyncio.Task[None] | None = None
        self._admin: asyncio.Task[None] | None = None
        self._kick = asyncio.Event()
        self._room = asyncio.Event()
        self._closed = False

        if not ray.is_initialized():
            kw: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
            kw.update(init_kwargs or {})
            try:
                ray.init(address=self.address, **kw)
            except Exception as e:
                raise SessionInfraError(
                    f"no Ray cluster at address={self.address!r}: {e} (start one with `ray start --head` and join "
                    "nodes with `ray start --address=HEAD:6379`, pass the head's address='HOST:6379', or "
                    "set RLF_RAY_ADDRESS=local to start a one-machine cluster in this process)") from None
        nodes = self._list_nodes()
        chosen = self._targets(nodes)
        if not chosen and not self.owner:
            raise SessionInfraError(f"no session hosts of group {self.group!r} in the cluster (attach= names the "
                                    "`group` of a RayBackend that is open; RLF_RAY_SESSIONS_GROUP sets it)")
        if not chosen:
            have = "; ".join(f"{n.node_id[:12]} labels={n.labels} resources={sorted(n.resources)}"
                             for n in nodes if n.alive) or "none alive"
            raise SessionInfraError(f"no Ray node matches the session node selector {self.selector.describe()!r} "
                                    f"(nodes: {have})")
        self._start_hosts_sync(chosen)
        if not any(h.state == "up" for h in self._hosts.values()):
            why = "; ".join(f"{h.where}: {h.last_error}" for h in self._hosts.values())
            self._kill_all_sync()
            raise SessionInfraError(f"no session host started on the {len(chosen)} selected node(s): {why}")

    # --------------------------------------------------------------------------------------------- nodes, hosts

    def _list_nodes(self) -> list[NodeInfo]:
        nodes = [NodeInfo.from_ray(d) for d in self._ray.nodes()]
        self._nodes = {n.node_id: n for n in nodes}
        return nodes

    def _targets(self, nodes: list[NodeInfo]) -> list[NodeInfo]:
        """The nodes to have hosts on: the selector's (owner), or those the group's named host actors are on
        (attach)."""
        if self.owner:
            return self.selector.select(nodes)
        prefix = f"{self.group}:"
        named = self._ray.util.list_named_actors(all_namespaces=True)
        ids = {str(a["name"])[len(prefix):] for a in named
               if isinstance(a, dict) and a.get("namespace") == NAMESPACE and str(a.get("name", "")).startswith(prefix)}
        return [n for n in nodes if n.alive and n.node_id in ids]

    def _cap(self, node: NodeInfo) -> int:
        if self.per_node_cap is not None:
            return self.per_node_cap
        if node.cpus < 1:
            log.warning("ray sessions: node %s declares %s CPUs to Ray, so it holds 1 session; set per_node_cap "
                        "(RLF_RAY_SESSIONS_PER_NODE)", node.node_id[:12], node.cpus)
        return max(1, int(node.cpus * self.sessions_per_cpu))

    def _config(self, cap: int) -> HostConfig:
        return HostConfig(group=self.group, run_id=owners.RUN_ID, inner=self.inner, inner_kwargs=self.inner_kwargs,
                          cap=cap, creates_per_s=self.creates_per_node_s, lease_s=self.lease_s, env=self.host_env,
                          seed_cache_mb=self.host_seed_cache_mb)

    def _launch(self, h: _Host) -> Any:
        """Start (owner) or look up (attach) the host actor of `h`; returns the ref of its start/stats reply."""
        ray = self._ray
        if self.owner:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts: dict[str, Any] = dict(
                name=h.name, namespace=NAMESPACE, num_cpus=0, max_restarts=0, max_task_retries=0,
                max_concurrency=max(1000, 8 * h.cap),
                scheduling_strategy=NodeAffinitySchedulingStrategy(h.node_id, soft=False))
            if self.runtime_env is not None:
                opts["runtime_env"] = self.runtime_env
            h.actor = _actor_class().options(**opts).remote(self._config(h.cap))
            return h.actor.start.remote()
        h.actor = ray.get_actor(h.name, namespace=NAMESPACE)
        return h.actor.stats.remote(self.client_id, self.lease_s)

    def _started(self, h: _Host, reply: Reply) -> None:
        if reply[0] != "ok":
            raise decode_error(reply[1], reply[2], reply[3], h.where)
        info = reply[1]
        if info.get("node_id") != h.node_id:  # impossible with hard node affinity, and checked
            raise SessionInfraError(f"the session host meant for node {h.node_id[:12]} runs on node "
                                    f"{str(info.get('node_id'))[:12]}")
        h.pid, h.hostname = info.get("pid"), info.get("hostname") or h.hostname
        h.cap = int(info.get("cap") or h.cap)
        h.n = int(info.get("n") or 0)
        h.state, h.missed, h.create_errors = "up", 0, 0
        self.counters["hosts_started"] += 1

    def _start_hosts_sync(self, nodes: list[NodeInfo]) -> None:
        ray = self._ray
        refs: dict[Any, _Host] = {}
        for n in nodes:
            h = _Host(n, f"{self.group}:{n.node_id}", self._cap(n))
            self._hosts[n.node_id] = h
            try:
                refs[self._launch(h)] = h
            except Exception as e:
                self._cool(h, f"{type(e).__name__}: {e}")
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.start_timeout_s)
        for ref, h in refs.items():
            if ref not in ready:
                self._cool(h, f"did not start within {self.start_timeout_s:.0f} s")
                continue
            try:
                self._started(h, ray.get(ref, timeout=10))
            except Exception as e:
                self._cool(h, f"{type(e).__name__}: {e}")

    def _cool(self, h: _Host, why: str) -> None:
        """Take `h` out of placement for a cooldown (longer after each failure) and kill its actor (owner)."""
        h.failures += 1
        h.state = "cooldown"
        h.last_error = why[:500]
        h.cooldown_until = time.monotonic() + self.host_cooldown_s * 2 ** min(h.failures - 1, 4)
        h.n = 0
        actor, h.actor = h.actor, None
        if actor is not None and self.owner:
            with contextlib.suppress(Exception):
                self._ray.kill(actor, no_restart=True)

    def _host_failed(self, h: _Host, why: str) -> None:
        """A host that died (or stopped answering): its sessions -- only its -- fail as infrastructure failures."""
        if h.state != "up":
            return
        lost = list(h.sessions.values())
        h.sessions.clear()
        reason = (f"the session host on {h.where} failed ({why[:300]}); the session is gone (an infrastructure "
                  "failure)")
        for s in lost:
            s._lost = reason
        self.counters["host_failures"] += 1
        self.counters["sessions_lost"] += len(lost)
        log.warning("ray sessions: host on %s failed (%s): %d session(s) lost; cooling down", h.where, why, len(lost))
        self._cool(h, why)
        self._room.set()

    def _kill_all_sync(self) -> None:
        for h in self._hosts.values():
            if h.actor is not None and self.owner:
                with contextlib.suppress(Exception):
                    self._ray.kill(h.actor, no_restart=True)
            h.actor, h.state = None, "gone"

    def hosts(self) -> list[HostInfo]:
        """A snapshot of every host: node, state, cap, load, this backend's sessions there, failures."""
        return [h.info() for h in self._hosts.values()]

    # --------------------------------------------------------------------------------------------- calls

    async def _ask(self, h: _Host, ref: Any, timeout_s: float, op: str) -> Reply:
        """The reply of one host call, at most `timeout_s` from now: a host that died, or did not answer in time,
        is a SessionInfraError (and a dead one fails all its sessions)."""
        ray_errors = self._ray.exceptions
        try:
            return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
        except TimeoutError:
            self._kick.set()  # ping it now
            raise SessionInfraError(f"the session host on {h.where} did not answer {op!r} within "
                                    f"{timeout_s:.0f} s") from None
        except ray_errors.ActorUnavailableError as e:  # unreachable for now: the pings decide
            self._kick.set()
            raise SessionInfraError(f"the session host on {h.where} was unreachable during {op!r}: "
                                    f"{str(e).splitlines()[0][:300]}") from None
        except ray_errors.RayActorError as e:  # the actor died (its process, or its node)
            self._host_failed(h, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
            raise SessionInfraError(f"the session host on {h.where} was lost during {op!r}: {type(e).__name__}"
                                    ) from None
        except ray_errors.RayError as e:  # this call failed in Ray (its arguments or reply, an object lost)
            self._kick.set()
            raise SessionInfraError(f"the call {op!r} to the session host on {h.where} failed in Ray: "
                                    f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}") from None

    def _forget(self, s: RaySession) -> None:
        """Drop `s`, lost to a call its host did not answer (or answered through a Ray failure), here, and close it
        on its host in the background (its outcome there is unknown)."""
        h = s._host
        if h.sessions.pop(s.rid, None) is not None:
            self.counters["sessions_lost"] += 1
        self._close_there(h, s.rid)

    def _close_there(self, h: _Host, rid: str) -> None:
        if h.actor is None:
            return
        with contextlib.suppress(Exception):
            ref = h.actor.close.remote(self.client_id, rid)
            fut = asyncio.wrap_future(ref.future())
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _pick(self, exclude: set[str]) -> _Host | None:
        """The spread rule: of the hosts that are up, not excluded and under their cap, the least loaded relative
        to its cap (load = the host's own count of its live, starting and closing sessions, plus our creates in
        flight to it); ties broken at random."""
        now = time.monotonic()
        cands = [h for h in self._hosts.values()
                 if h.state == "up" and h.node_id not in exclude and h.load() < h.cap and h.paused_until <= now]
        if not cands:
            return None
        random.shuffle(cands)
        return min(cands, key=lambda h: (h.load() / h.cap, h.load()))

    async def _seed(self, spec: SessionSpec) -> tuple[str, list[Any]] | None:
        if not self.ship_seeds or spec.seed_dir is None:
            return None
        p = os.path.realpath(spec.seed_dir)
        try:
            st = os.stat(p)
        except OSError as e:
            raise SessionInfraError(f"the seed {spec.seed_dir!r} is gone: {e}") from None
        key = (p, st.st_dev, st.st_ino, st.st_mtime_ns)
        task = self._seeds.get(key)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            ray = self._ray

            def put() -> tuple[str, Any, int]:
                data = _pack(p)
                return hashlib.sha256(data).hexdigest()[:32], ray.put(data), len(data)

            task = asyncio.get_running_loop().create_task(asyncio.to_thread(put))
            self._seeds[key] = task
        self._seeds.move_to_end(key)
        try:
            digest, ref, size = await asyncio.shield(task)
        except Exception as e:
            raise SessionInfraError(f"the seed {spec.seed_dir!r} could not be sent to the session nodes: {e}"
                                    ) from None
        self._seed_sizes[key] = size
        total = sum(self._seed_sizes.values())
        while total > self.seed_cache_bytes and len(self._seeds) > 1:  # the oldest go (a pending create keeps its ref)
            old, _ = self._seeds.popitem(last=False)
            total -= self._seed_sizes.pop(old, 0)
        return digest, [ref]

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._kick = asyncio.Event()
            self._room = asyncio.Event()
            self._task = loop.create_task(self._maintain())

    async def create(self, spec: SessionSpec) -> RaySession:
        if self._closed:
            raise SessionClosed("the ray session backend is closed")
        if not isinstance(spec, SessionSpec):
            raise TypeError(f"create takes a SessionSpec, got {type(spec).__name__}")
        self._ensure_loop()
        deadline = time.monotonic() + self.create_timeout_s
        seed = await self._seed(spec)
        rid = f"ray-{uuid.uuid4().hex[:16]}"
        failed: set[str] = set()
        last: Exception | None = None
        while True:
            left = deadline - time.monotonic()
            h = self._pick(failed)
            if h is None:
                others = [x for x in self._hosts.values() if x.state == "up" and x.node_id not in failed]
                if last is not None and (not others or left <= 0):
                    raise last
                if left <= 0:
                    caps = ", ".join(f"{x.where}: {x.state} {x.load()}/{x.cap}" for x in self._hosts.values())
                    raise SessionInfraError(f"no session host had room within {self.create_timeout_s:.0f} s "
                                            f"({caps})")
                self._room.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._room.wait(), min(left, 1.0))
                if not self._room.is_set():
                    self._kick.set()  # ask the hosts for their counts (sessions of other clients may have ended)
                continue
            h.inflight += 1
            h.pending.add(rid)
            try:
                ref = h.actor.create.remote(self.client_id, rid, spec, seed, self.lease_s)
                reply = await self._ask(h, ref, max(1.0, left), "create")
            except SessionInfraError as e:
                self._close_there(h, rid)  # in case it was created after all
                failed.add(h.node_id)
                last = e
                self.counters["create_retries"] += 1
                if len(failed) >= 3 or time.monotonic() >= deadline:
                    raise
                continue
            except BaseException:
                self._close_there(h, rid)
                raise
            finally:
                h.inflight -= 1
                h.pending.discard(rid)
            if reply[0] == "full":
                h.n = max(int(reply[1]), h.cap)
                continue
            if reply[0] == "err":
                exc = decode_error(reply[1], reply[2], reply[3], h.where)
                if type(exc) is SessionInfraError:  # the node's failure: try another node
                    h.create_errors += 1
                    if h.create_errors >= 3:  # its live sessions go on; it gets no new ones for a while
                        log.warning("ray sessions: %d creates in a row failed on %s (%s); no creates there for "
                                    "%.0f s", h.create_errors, h.where, exc, self.host_cooldown_s)
                        h.paused_until = time.monotonic() + self.host_cooldown_s
                        h.create_errors = 0
                        h.last_error = str(exc)[:500]
                    failed.add(h.node_id)
                    last = exc
                    self.counters["create_retries"] += 1
                    if len(failed) >= 3:
                        raise exc
                    continue
                raise exc
            info = reply[1]
            h.n = int(info.get("n", h.n))
            h.create_errors = 0
            s = RaySession(self, h, rid, info, spec)
            if h.state != "up" or self._closed:  # the host failed, or we closed, while the reply travelled
                self._close_there(h, rid)
                raise SessionInfraError(f"the session host on {h.where} failed while the session started")
            h.sessions[rid] = s
            self.counters["creates"] += 1
            return s

    # --------------------------------------------------------------------------------------------- health

    async def _ping(self, h: _Host) -> None:
        if h.state != "up" or h.actor is None:
            return
        try:
            reply = await self._ask(h, h.actor.stats.remote(self.client_id, self.lease_s), PING_TIMEOUT_S, "stats")
        except SessionInfraError as e:
            if h.state == "up":
                h.missed += 1
                if h.missed >= 2:
                    self._host_failed(h, f"missed {h.missed} pings: {e}")
            return
        h.missed = 0
        if reply[0] != "ok":
            return
        info = reply[1]
        h.n = int(info.get("n", h.n))
        for rid in set(info.get("mine") or ()) - set(h.sessions) - h.pending:
            self._close_there(h, rid)  # a create whose reply we lost, a close that did not arrive
        self._room.set()

    async def _discover(self) -> None:
        try:
            nodes = await asyncio.wait_for(asyncio.to_thread(self._list_nodes), 30)
        except Exception as e:
            log.warning("ray sessions: could not list the cluster's nodes: %r", e)
            return
        alive = {n.node_id for n in nodes if n.alive}
        for h in self._hosts.values():
            if h.node_id not in alive and h.state != "gone":
                self._host_failed(h, "its node left the cluster")
                h.state = "gone"
        try:
            targets = await asyncio.wait_for(asyncio.to_thread(self._targets, nodes), 30)
        except Exception as e:
            log.warning("ray sessions: could not list the session hosts: %r", e)
            return
        new = []
        for n in targets:
            old = self._hosts.get(n.node_id)
            if old is not None and old.state == "gone":  # listed dead once, alive again: a new start
                old.state, old.cooldown_until = "cooldown", 0.0
            if old is None:
                h = _Host(n, f"{self.group}:{n.node_id}", self._cap(n))
                self._hosts[n.node_id] = h
                new.append(h)
        await asyncio.gather(*(self._revive(h) for h in new))

    async def _revive(self, h: _Host) -> None:
        if h.node_id not in self._nodes or not self._nodes[h.node_id].alive:
            h.state = "gone"
            return
        h.state = "starting"
        try:
            ref = self._launch(h)
            self._started(h, await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.start_timeout_s))
            h.sessions.clear()
            log.info("ray sessions: host on %s is up", h.where)
            self._room.set()
        except Exception as e:
            self._cool(h, f"restart: {type(e).__name__}: {str(e)[:300]}")

    async def _admin_round(self, discover: bool) -> None:
        """Find new nodes (or the group's hosts) and start the hosts whose cooldown is over; in a task of its own,
        so that a slow start never holds up the pings (their leases)."""
        try:
            if discover:
                await self._discover()
            due = [h for h in self._hosts.values() if h.state == "cooldown" and time.monotonic() >= h.cooldown_until]
            await asyncio.gather(*(self._revive(h) for h in due))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("ray sessions: discovery: %r", e)

    async def _maintain(self) -> None:
        next_ping = next_discover = time.monotonic()
        admin: asyncio.Task[None] | None = None
        while not self._closed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._kick.wait(), 1.0)
            kicked = self._kick.is_set()
            self._kick.clear()
            now = time.monotonic()
            try:
                if kicked or now >= next_ping:
                    next_ping = now + self.health_every_s
                    await asyncio.gather(*(self._ping(h) for h in list(self._hosts.values())))
                due = any(h.state == "cooldown" and now >= h.cooldown_until for h in self._hosts.values())
                if (admin is None or admin.done()) and (now >= next_discover or due):
                    discover = now >= next_discover
                    if discover:
                        next_discover = now + self.discover_every_s
                    admin = asyncio.get_running_loop().create_task(self._admin_round(discover))
                    self._admin = admin
            except asyncio.CancelledError:
                if admin is not None:
                    admin.cancel()
                raise
            except Exception as e:  # the loop never dies
                log.warning("ray sessions: maintenance: %r", e)

    # --------------------------------------------------------------------------------------------- protocol

    def reap(self) -> int:
        """Each host reaps its node now (its inner backend's reaper: sessions whose owner is gone)."""
        refs = {h.actor.reap.remote(): h for h in self._hosts.values() if h.state == "up" and h.actor is not None}
        n = 0
        with contextlib.suppress(Exception):
            ready, _ = self._ray.wait(list(refs), num_returns=len(refs), timeout=60)
            for r in ready:
                reply = self._ray.get(r)
                if reply[0] == "ok":
                    n += int(reply[1])
        return n

    def check_image(self, image: str) -> None:
        """ValueError (naming the node) when a session node cannot start sessions of `image`."""
        up = [h for h in self._hosts.values() if h.state == "up" and h.actor is not None]
        refs = {h.actor.check_image.remote(image): h for h in up}
        ready, pending = self._ray.wait(list(refs), num_returns=len(refs), timeout=600)
        if pending:
            raise SessionInfraError(f"the session hosts did not check image {image!r} within 600 s: "
                                    + ", ".join(refs[r].where for r in pending))
        for r in ready:
            h = refs[r]
            try:
                reply = self._ray.get(r)
            except Exception as e:
                raise SessionInfraError(f"the session host on {h.where} failed checking {image!r}: {e}") from None
            if reply[0] != "ok":
                exc = decode_error(reply[1], reply[2], reply[3], h.where)
                if isinstance(exc, ValueError):
                    raise type(exc)(f"{exc} (on the session {h.where})")
                raise exc

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in (self._task, self._admin):
            if t is not None:
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
        sessions = [s for h in self._hosts.values() for s in list(h.sessions.values())]
        await asyncio.gather(*(s.aclose() for s in sessions), return_exceptions=True)
        if self.owner:
            up = [h for h in self._hosts.values() if h.actor is not None]

            async def down(h: _Host) -> None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.wrap_future(h.actor.shutdown.remote().future()), 120)

            await asyncio.gather(*(down(h) for h in up), return_exceptions=True)
            await asyncio.to_thread(self._kill_all_sync)
        self._seeds.clear()
        self._seed_sizes.clear()
