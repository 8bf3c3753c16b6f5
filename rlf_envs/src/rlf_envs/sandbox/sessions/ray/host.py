"""The host actor of the ray session backend: one per session node, owning that node's local (or docker) backend.

`RayBackend` makes it a Ray actor (`ray.remote(SessionHost)`, async, pinned to its node, `num_cpus=0`, no restarts:
the client replaces a failed host itself). Every method returns a tagged reply (`wire.py`) and never raises. The host
is the authority on its node's load: it refuses a create past its cap (`("full", load)`), passes creates through its
own rate limit, counts live, starting and closing sessions, and tells each client which sessions it holds for it
(so a create whose reply was lost is closed, not leaked).

What a host does on its own, every second: closes the sessions of a client it has not heard from for its lease
(`lease_s`, each client's own: one that died without closing, one cut off from the cluster), and those past their
wall clock (their later calls raise SessionExpired, as on the backend underneath). At start it spawns the node's
watchdog (`watch.py`), which reaps what the host leaves if its process dies (a SIGKILLed driver takes its owned
actors with it).

Seeds: a `SessionSpec.seed_dir` names a directory on the driver's machine; the client ships it once as a tar in
Ray's object store (keyed by its digest) and the host unpacks it once into its node-local cache
(`$RLF_CACHE_DIR/ray-seeds/<pid>-<start>/<digest>/`, 0700), kept while a session uses it, evicted least recently
used past `seed_cache_mb`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import logging
import os
import socket
import subprocess
import sys
import tarfile
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlf_envs.sandbox import cleanup
from rlf_envs.sandbox.sessions import images, owners
from rlf_envs.sandbox.sessions.ray.wire import HostConfig, Reply, encode_error
from rlf_envs.sandbox.sessions.types import (
    CreateRate,
    Session,
    SessionBackend,
    SessionClosed,
    SessionError,
    SessionExpired,
    SessionInfraError,
    SessionSpec,
)

log = logging.getLogger(__name__)

#: the Session methods a client may call through `SessionHost.call`
OPS = frozenset({"exec", "read_file", "write_file", "diff"})
#: how many ended sessions a host remembers (so a late call gets the same error the backend underneath would give)
TOMBS = 10_000
#: seconds past a session's wall clock after which its host closes it (the backend underneath kills it at +1 s)
EXPIRE_GRACE_S = 2.0


@dataclass
class _Entry:
    session: Session
    client: str
    deadline: float
    digest: str | None


def _unpack(data: bytes, dest: str) -> None:
    """Unpack a seed tar into `dest` (atomically: a temporary sibling renamed into place)."""
    tmp = f"{dest}.tmp-{uuid.uuid4().hex[:8]}"
    os.mkdir(tmp, 0o755)
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            tar.extractall(tmp, filter="tar")
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isdir(dest):
                raise
    finally:
        if os.path.lexists(tmp):
            cleanup.remove_tree(tmp, 60.0)


class SeedCache:
    """Seeds unpacked on this node, by digest; referenced ones are never removed."""

    def __init__(self, base: str, max_bytes: int) -> None:
        self.base = base
        self.max_bytes = max_bytes
        os.makedirs(base, mode=0o700, exist_ok=True)
        os.chmod(base, 0o700)
        self.refs: dict[str, int] = {}
        self.sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._locks: dict[str, asyncio.Lock] = {}

    async def acquire(self, digest: str, ref: Any) -> str:
        if not digest.isalnum():
            raise SessionError(f"bad seed digest {digest[:80]!r}")
        path = os.path.join(self.base, digest)
        self.refs[digest] = self.refs.get(digest, 0) + 1
        try:
            async with self._locks.setdefault(digest, asyncio.Lock()):
                if digest not in self.sizes:
                    data = await ref  # from Ray's object store (the driver put it there)
                    await asyncio.to_thread(_unpack, bytes(data), path)
                    self.sizes[digest] = len(data)
                self.sizes.move_to_end(digest)
        except BaseException:
            self.release(digest)
            raise
        self._evict()
        return path

    def release(self, digest: str | None) -> None:
        if digest is None:
            return
        n = self.refs.get(digest, 0) - 1
        if n > 0:
            self.refs[digest] = n
        else:
            self.refs.pop(digest, None)

    def _evict(self) -> None:
        total = sum(self.sizes.values())
        for d in list(self.sizes):
            if total <= self.max_bytes:
                break
            if self.refs.get(d):
                continue
            total -= self.sizes.pop(d)
            self._locks.pop(d, None)
            cleanup.discard(os.path.join(self.base, d))

    def remove_all(self) -> None:
        cleanup.remove_tree(self.base, 60.0)


def seed_base() -> Path:
    return Path(os.environ.get("RLF_CACHE_DIR") or Path.home() / ".cache" / "rlf") / "ray-seeds"


def _sweep_seed_caches(base: Path) -> None:
    """Remove the seed caches of hosts whose process is gone (named <pid>-<start>)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            pid, _, start = name.partition("-")
            if pid.isdigit() and start.isdigit() and not owners.alive(int(pid), int(start)):
                cleanup.remove_tree(base / name, 30.0)


class SessionHost:
    """The actor's body (plain class; `RayBackend` wraps it with `ray.remote`)."""

    def __init__(self, cfg: HostConfig) -> None:
        self.cfg = cfg
        os.environ.update(cfg.env)
        os.environ["RLF_RUN_ID"] = cfg.run_id
        owners.RUN_ID = cfg.run_id  # every label this host's backend writes carries the driver's run id
        self.node_id = ""
        self.backend: SessionBackend | None = None
        self.sessions: dict[str, _Entry] = {}
        self.starting = 0
        self.closing = 0
        self.cancelled: set[str] = set()
        self.tombs: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.clients: dict[str, tuple[float, float]] = {}  # client -> (last heard of, its lease)
        self.rate = CreateRate(cfg.creates_per_s, 8)
        self.seeds: SeedCache | None = None
        self.created = 0
        self._task: asyncio.Task[None] | None = None
        self._images: dict[str, asyncio.Lock] = {}

    # ----------------------------------------------------------------------------------------------- lifecycle

    def _load(self) -> int:
        return len(self.sessions) + self.starting + self.closing

    def _info(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "pid": os.getpid(), "hostname": socket.gethostname(), "cap": self.cfg.cap,
                "n": self._load(), "inner": self.cfg.inner}

    async def start(self) -> Reply:
        if self.backend is not None:
            return ("ok", self._info())
        try:
            import ray

            self.node_id = ray.get_runtime_context().get_node_id()
            if self.cfg.inner == "local":
                from rlf_envs.sandbox.sessions.local import LocalBackend

                self.backend = LocalBackend(**self.cfg.inner_kwargs)
            elif self.cfg.inner == "docker":
                from rlf_envs.sandbox.sessions.docker import DockerBackend

                self.backend = DockerBackend(**self.cfg.inner_kwargs)
            else:
                raise ValueError(f"unknown inner backend {self.cfg.inner!r}: use 'local' or 'docker'")
            base = seed_base()
            base.mkdir(parents=True, exist_ok=True, mode=0o700)
            _sweep_seed_caches(base)
            me = os.getpid()
            self.seeds = SeedCache(str(base / f"{me}-{owners.start_time(me)}"), self.cfg.seed_cache_mb << 20)
            self._spawn_watchdog()
            self._task = asyncio.get_running_loop().create_task(self._maintain())
        except Exception as e:
            return encode_error(e)
        return ("ok", self._info())

    def _spawn_watchdog(self) -> None:
        me = os.getpid()
        args = [sys.executable, "-m", "rlf_envs.sandbox.sessions.ray.watch", "--pid", str(me),
                "--inner", self.cfg.inner]
        st = owners.start_time(me)
        if st is not None:
            args += ["--start", str(st)]
        if self.seeds is not None:
            args += ["--seeds", self.seeds.base]
        url = self.cfg.inner_kwargs.get("base_url")
        if self.cfg.inner == "docker" and url:
            args += ["--docker-url", str(url)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, close_fds=True, env=env)
        p.wait(30)  # it forks the watchdog off and exits at once

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                now = time.monotonic()
                silent = {c: lease for c, (seen, lease) in self.clients.items() if now - seen > lease}
                for rid, e in list(self.sessions.items()):
                    if e.client in silent:
                        log.warning("session host: closing session %s, its client was silent for %.0f s",
                                    e.session.id, silent[e.client])
                        await self._close(rid, ("SessionInfraError", f"session {e.session.id} was closed by its host: "
                                                f"its client was silent for {silent[e.client]:g} s (its lease)"))
                    elif now > e.deadline:
                        await self._close(rid, ("SessionExpired", f"session {e.session.id} ran past its wall clock "
                                                f"(session_timeout_s={e.session.spec.limits.session_timeout_s})"))
                for c in silent:
                    self.clients.pop(c, None)
            except Exception as e:  # never let the loop die
                log.warning("session host maintenance: %r", e)

    def _touch(self, client: str, lease_s: float | None = None) -> None:
        """`client` was heard of now; it may be silent `lease_s` (its own, else what it said before, else the
        host's) before its sessions are closed."""
        old = self.clients.get(client)
        lease = lease_s if lease_s is not None and lease_s > 0 else (old[1] if old else self.cfg.lease_s)
        self.clients[client] = (time.monotonic(), float(lease))

    def _tomb(self, rid: str, kind: str, message: str) -> None:
        self.tombs[rid] = (kind, message)
        while len(self.tombs) > TOMBS:
            self.tombs.popitem(last=False)

    async def _close(self, rid: str, tomb: tuple[str, str]) -> None:
        e = self.sessions.pop(rid, None)
        if e is None:
            return
        self._tomb(rid, *tomb)
        self.closing += 1
        try:
            await e.session.aclose()
        except Exception as ex:  # close never raises by contract
            log.warning("session close failed: %r", ex)
        finally:
            self.closing -= 1
            if self.seeds is not None:
                self.seeds.release(e.digest)

    def _missing(self, rid: str) -> Reply:
        kind, msg = self.tombs.get(rid, ("", ""))
        cls = {"SessionExpired": SessionExpired, "SessionClosed": SessionClosed,
               "SessionInfraError": SessionInfraError}.get(kind)
        if cls is not None:
            return encode_error(cls(msg))
        return encode_error(SessionInfraError(f"the session host on node {self.node_id[:12]} holds no session "
                                              f"{rid} (was the host replaced?)"))

    # ------------------------------------------------------------------------------------------------ requests

    async def create(self, client: str, rid: str, spec: SessionSpec, seed: tuple[str, list[Any]] | None,
                     lease_s: float | None = None) -> Reply:
        self._touch(client, lease_s)
        if self.backend is None:
            return encode_error(SessionInfraError("the session host is not started"))
        if rid in self.sessions:
            e = self.sessions[rid]
            return ("ok", {"id": e.session.id, "uid": getattr(e.session, "uid", None), "n": self._load()})
        if self._load() >= self.cfg.cap:
            return ("full", self._load())
        self.starting += 1
        digest = None
        try:
            await self.rate.wait()
            if self.cfg.inner == "local":  # an archive's first unpack takes a while: not on this actor's loop
                async with self._images.setdefault(spec.image, asyncio.Lock()):
                    await asyncio.to_thread(images.resolve_local, spec.image)
            local = spec
            if seed is not None and self.seeds is not None:
                digest = seed[0]
                path = await self.seeds.acquire(digest, seed[1][0])
                local = dataclasses.replace(spec, seed_dir=path)
            s = await self.backend.create(local)
        except Exception as ex:
            if self.seeds is not None:
                self.seeds.release(digest)
            return encode_error(ex)
        finally:
            self.starting -= 1
        if rid in self.cancelled:  # the client gave up on this create (its deadline): nothing is kept of it
            self.cancelled.discard(rid)
            with contextlib.suppress(Exception):
                await s.aclose()
            if self.seeds is not None:
                self.seeds.release(digest)
            return encode_error(SessionInfraError("the create was cancelled by its client"))
        self.created += 1
        self.sessions[rid] = _Entry(s, client, time.monotonic() + spec.limits.session_timeout_s + EXPIRE_GRACE_S,
                                    digest)
        return ("ok", {"id": s.id, "uid": getattr(s, "uid", None), "n": self._load()})

    async def call(self, client: str, rid: str, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Reply:
        self._touch(client)
        e = self.sessions.get(rid)
        if e is None:
            return self._missing(rid)
        if op not in OPS:
            return encode_error(SessionError(f"unknown session call {op!r}"))
        try:
            return ("ok", await getattr(e.session, op)(*args, **kwargs))
        except Exception as ex:
            return encode_error(ex)

    async def close(self, client: str, rid: str) -> Reply:
        self._touch(client)
        e = self.sessions.get(rid)
        if e is not None:
            await self._close(rid, ("SessionClosed", f"session {e.session.id} is closed"))
        elif rid not in self.tombs and self.starting:
            self.cancelled.add(rid)  # a create still starting: dropped when it ends
            while len(self.cancelled) > TOMBS:
                self.cancelled.pop()
        return ("ok", self._load())

    async def stats(self, client: str | None = None, lease_s: float | None = None) -> Reply:
        if client is not None:
            self._touch(client, lease_s)
        info = self._info()
        info.update(live=len(self.sessions), starting=self.starting, closing=self.closing, created=self.created,
                    mine=[rid for rid, e in self.sessions.items() if e.client == client],
                    clients=len(self.clients))
        return ("ok", info)

    async def check_image(self, image: str) -> Reply:
        try:
            if self.backend is None:
                raise SessionInfraError("the session host has not started its backend")
            await asyncio.to_thread(self.backend.check_image, image)
        except Exception as e:
            return encode_error(e)
        return ("ok", None)

    async def reap(self) -> Reply:
        try:
            return ("ok", self.backend.reap() if self.backend is not None else 0)
        except Exception as e:
            return encode_error(e)

    async def shutdown(self) -> Reply:
        """Close every session (of every client) and the backend underneath; the actor is killed after this."""
        if self._task is not None:
            self._task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*(self._close(rid, ("SessionInfraError", "the session host was shut down"))
                                   for rid in list(self.sessions)), return_exceptions=True)
        if self.backend is not None:
            with contextlib.suppress(Exception):
                await self.backend.aclose()
        if self.seeds is not None:
            await asyncio.to_thread(self.seeds.remove_all)
        return ("ok", None)
