"""Docker backend against a hostile session (an outside attack round) and its error classes: the deadline kill and
the session's lifetime do not depend on anything the session's root can write, a container ends by itself at its
wall clock with its owner SIGKILLed and no reaper running, the session's pid 1 cannot be killed or traced from
inside, commands run under `bash -lc` as the image's user, `diff(max_bytes)`, SessionExpired, the policy's errors
(bad paths, large files, large diffs) are SessionErrors and the engine's are SessionInfraErrors, and Harbor images
built for a run keep their logs off stdout and leave the engine when the backend closes.

Skipped with the reason when the docker SDK, an engine (DOCKER_HOST) or the test image (RLF_DOCKER_TEST_IMAGE,
default rlf-debian-test:12, which .ci/run imports) is missing."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlf_envs.sandbox.sessions import (
    SessionDiffTooLarge,
    SessionError,
    SessionExpired,
    SessionFileNotFound,
    SessionInfraError,
    SessionLimitExceeded,
    SessionLimits,
    SessionSpec,
)
from tests.envs.sandbox.sessions.test_docker_sessions import REASON

if REASON:
    pytestmark = pytest.mark.skip(reason=REASON)

IMAGE = os.environ.get("RLF_DOCKER_TEST_IMAGE", "rlf-debian-test:12")
FAST = SessionLimits(exec_timeout_s=20, session_timeout_s=300, memory_mb=512, pids=128, disk_mb=64)
PS = "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done 2>/dev/null"


def run(fn: Callable[[Any], Awaitable[Any]], **kw: Any) -> Any:
    from rlf_envs.sandbox.sessions.docker import DockerBackend

    async def main() -> Any:
        b = DockerBackend(**{"pool_size": 0, **kw})
        try:
            return await fn(b)
        finally:
            await b.aclose()

    return asyncio.run(main())


def spec(image: str = IMAGE, **kw: Any) -> SessionSpec:
    return SessionSpec(image=f"docker:{image}", limits=kw.pop("limits", FAST), **kw)


@pytest.fixture()
def client() -> Iterator[Any]:
    import docker

    c = docker.from_env(timeout=120)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture()
def derived(client: Any) -> Iterator[Callable[..., str]]:
    """Images derived from the test image by one command (`docker commit`), removed after the test."""
    made: list[str] = []

    def make(cmd: str, **conf: Any) -> str:
        c = client.containers.run(IMAGE, ["sh", "-c", cmd], detach=True, network_mode="none")
        try:
            assert c.wait(timeout=60)["StatusCode"] == 0, c.logs()
            tag = f"rlf-test-derived-{uuid.uuid4().hex[:8]}:1"
            repo, t = tag.split(":")
            c.commit(repository=repo, tag=t, conf=conf or None)
        finally:
            c.remove(force=True)
        made.append(tag)
        return tag

    try:
        yield make
    finally:
        for t in made:
            try:
                client.images.remove(t, force=True)
            except Exception:
                pass


# --- 1. the deadline kill ------------------------------------------------------------------------------------------

SABOTAGE = ("echo 999999999 > /tmp/.rlf-exec-pid; chmod 444 /tmp/.rlf-exec-pid; "
            "for b in timeout kill cat; do p=$(command -v $b) && rm -f $p && printf '#!/bin/sh\\nexit 0\\n' > $p "
            "&& chmod 755 $p; done; echo sabotaged")
ATTACK = "setsid sh -c 'sleep 996 > /dev/null 2>&1 &'; setsid sleep 995 > /dev/null 2>&1 & sleep 994"


def _deadline_attack(b: Any, *, host_kill: bool) -> Awaitable[None]:
    async def go() -> None:
        async with await b.create(spec()) as s:
            if not host_kill:
                s._host = None  # as with a remote engine: the in-container fallback kill
            r = await s.exec(SABOTAGE + "; ln -sf /bin/true /bin/sh" * host_kill)
            assert r.stdout.strip() == "sabotaged", r
            await s.exec("sleep 1000 > /dev/null 2>&1 &")  # an earlier call's background process: not this call's
            # (a process started within a clock tick before a call, or on a remote engine within the round trip of
            # one exec, cannot be told from the call's own: the kill errs on the side of taking it)
            await asyncio.sleep(0.3 if host_kill else 1.5)
            t0 = time.monotonic()
            r = await s.exec(ATTACK, timeout_s=1.5)
            assert r.timed_out and r.exit_code == 124 and time.monotonic() - t0 < 60, r
            ps = (await s.exec(PS, timeout_s=30)).stdout
            assert "sleep 1000" in ps, ps
            assert not any(f"sleep {n}" in ps for n in (996, 995, 994)), ps

    return go()


def test_deadline_kill_survives_a_rewritten_pid_file_and_replaced_binaries() -> None:
    """The command writes the old wrapper's pid file, replaces timeout, kill, cat and /bin/sh: everything the call
    started (setsid'd, double-forked) still dies at the deadline; what an earlier call left running does not."""
    run(lambda b: _deadline_attack(b, host_kill=True))


def test_deadline_kill_in_container_fallback_uses_no_pid_file_nor_the_images_tools() -> None:
    """Where the engine's processes are out of the host's reach (a remote engine): the in-container kill picks the
    call's processes by their kernel start times (no pid file) with the shell's builtins only."""
    run(lambda b: _deadline_attack(b, host_kill=False))


@pytest.mark.parametrize("engine_answers", [True, False])
def test_an_exec_that_outlives_its_deadline_kill_ends_the_session(monkeypatch: pytest.MonkeyPatch,
                                                                  engine_answers: bool) -> None:
    """A call that does not end within GRACE_S of its deadline kill (here: the kill is made to miss; on an engine
    whose exec output stays open while any process holds it, a process of the session holding the call's output)
    ends the session: the policy's failure (SessionLimitExceeded 'exec_deadline') while the engine answers a ping,
    the host's (SessionInfraError) when it does not."""
    from rlf_envs.sandbox.sessions import docker as mod

    monkeypatch.setattr(mod, "GRACE_S", 3.0)

    async def missed(self: Any, *a: Any) -> None:
        return None

    async def answers(self: Any) -> bool:
        return engine_answers

    monkeypatch.setattr(mod.DockerSession, "_kill_since", missed)
    monkeypatch.setattr(mod.DockerBackend, "_healthy", answers)

    async def go(b: Any) -> None:
        s = await b.create(spec())
        try:
            t0 = time.monotonic()
            with pytest.raises(SessionError) as e:
                await s.exec("sleep 993", timeout_s=1.0)
            assert time.monotonic() - t0 < 60
            if engine_answers:
                assert isinstance(e.value, SessionLimitExceeded) and e.value.limit == "exec_deadline", e.value
            else:
                assert isinstance(e.value, SessionInfraError), e.value
            with pytest.raises(SessionError):  # the session was ended
                await s.exec("true")
        finally:
            await s.aclose()

    run(go)


def test_one_process_per_call_under_bash_login_shell() -> None:
    """A str runs as `bash -lc CMD`, the exec's own process (no wrapper shell, no `timeout`): bash syntax works."""

    async def go(b: Any) -> None:
        async with await b.create(spec()) as s:
            r = await s.exec('[[ -n "$BASH_VERSION" ]] && shopt -q login_shell && source /dev/null && '
                             'echo "ok ppid=$PPID"')
            assert r.stdout == "ok ppid=0\n", r  # its parent is outside the container: nothing wraps it
            r = await s.exec(["sh", "-c", "echo $PPID"])
            assert r.stdout == "0\n", r
            assert (await s.exec(["no-such-program"])).exit_code == 127

    run(go)


def test_sh_where_the_image_has_no_bash(derived: Callable[..., str]) -> None:
    img = derived("rm -f /usr/bin/bash /bin/bash")

    async def go(b: Any) -> None:
        async with await b.create(spec(img)) as s:
            r = await s.exec("echo $((6 * 7)); test -z \"$BASH_VERSION\" && echo no-bash")
            assert r.stdout == "42\nno-bash\n", r

    run(go)


# --- 2. the session's lifetime -------------------------------------------------------------------------------------

OWNER = textwrap.dedent("""
    import asyncio, os, time
    from rlf_envs.sandbox.sessions import SessionLimits, SessionSpec
    from rlf_envs.sandbox.sessions.docker import DockerBackend
    async def main():
        b = DockerBackend(pool_size=1, pool_idle_s=3, reap_every_s=0)
        lim = SessionLimits(session_timeout_s=4, exec_timeout_s=4)
        sp = SessionSpec(image="docker:" + os.environ["IMG"], limits=lim)
        s = await b.create(sp)
        await s.exec("setsid sh -c 'while :; do :; done' > /dev/null 2>&1 &")
        for _ in range(600):
            warm = [box.c for box in b.pool.idle(b._key(sp))]
            if warm:
                break
            await asyncio.sleep(0.05)
        print(s._c.id, *(c.id for c in warm), flush=True)
        await asyncio.sleep(1000)
    asyncio.run(main())
""")


def test_a_container_ends_at_its_wall_clock_with_its_owner_sigkilled_and_no_reaper(client: Any) -> None:
    env = {**os.environ, "IMG": IMAGE, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    p = subprocess.Popen([sys.executable, "-c", OWNER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        ids = p.stdout.readline().split()
        assert len(ids) == 2, ids  # the session's container and a warm one
        p.send_signal(signal.SIGKILL)
        p.wait(30)
        t0 = time.monotonic()
        running = [c.id for c in client.containers.list(filters={"id": ids[0]})]
        assert running == [ids[0]], "the session's container should still run right after its owner died"

        def alive() -> list[str]:
            return [c.id for c in client.containers.list(filters={"label": "rlf.session"}) if c.id in ids]

        while alive() and time.monotonic() - t0 < 120:  # session 4 s (+ a margin; the warm one + its idle 3 s)
            time.sleep(1)
        assert alive() == [], "containers of a dead owner still run past their wall clock with no reaper"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(30)
        if p.stdout is not None:
            p.stdout.close()
        for c in client.containers.list(all=True, filters={"label": "rlf.session"}):
            if c.id in ids:
                c.remove(force=True)


def test_the_pool_never_hands_out_a_container_older_than_its_idle_cap(client: Any) -> None:
    """A warm container's pid 1 outlives a session's wall clock by the pool's idle cap, so an older one is refused
    (removed) and a fresh one made: a leased container always outlives its session."""

    async def go(b: Any) -> None:
        await (await b.create(spec())).aclose()
        key = b._key(spec())
        for _ in range(600):
            if b.pool.idle(key):
                break
            await asyncio.sleep(0.05)
        old = b.pool.idle(key)[0].c.id
        await asyncio.sleep(2.5)
        async with await b.create(spec()) as s:
            assert s._c.id != old
            assert (await s.exec("cat /proc/1/cmdline | tr '\\0' ' '")).stdout.startswith("/.rlf/sleep ")
        assert not [c for c in client.containers.list(all=True, filters={"id": old}) if c.status == "running"]

    run(go, pool_size=1, pool_idle_s=2)


PTRACE = textwrap.dedent("""
    import ctypes, os
    os.kill(1, 9); os.kill(1, 19)
    os.setgid(65534); os.setuid(65534)
    libc = ctypes.CDLL(None, use_errno=True)
    print("attach", libc.ptrace(16, 1, 0, 0), ctypes.get_errno())
    try:
        open("/proc/1/mem", "rb")
        print("mem opened")
    except OSError as e:
        print("mem", e.errno)
""")


def test_pid_1_cannot_be_killed_or_traced_from_inside() -> None:
    """The session's root sends SIGKILL and SIGSTOP to pid 1 (dropped: a pid namespace's init), then becomes pid 1's
    uid to ptrace it or write its memory (refused: pid 1 runs an execute-only binary, so it is not dumpable)."""

    async def go(b: Any) -> None:
        async with await b.create(spec()) as s:
            r = await s.exec(["python3", "-c", PTRACE])
            assert r.exit_code == 0, r
            assert "attach -1 1\n" in r.stdout and "mem 13" in r.stdout, r
            r = await s.exec("grep -E '^(State|Uid)' /proc/1/status")
            assert "S (sleeping)" in r.stdout and "65534" in r.stdout, r
            assert (await s.exec("id -u")).stdout == "0\n"

    run(go)


def test_commands_run_as_the_images_own_user(derived: Callable[..., str]) -> None:
    img = derived("mkdir -p /home/app && chown 65534:65534 /home/app", User="65534:65534", WorkingDir="/home/app")

    async def go(b: Any) -> None:
        async with await b.create(spec(img, workdir="/home/app")) as s:
            r = await s.exec("id -u; grep NoNewPrivs /proc/self/status")
            assert r.stdout.split() == ["65534", "NoNewPrivs:", "1"], r
            await s.exec("echo hi > mine.txt")
            assert await s.read_file("mine.txt") == b"hi\n"
            await s.write_file("sub/w.txt", "a\n")  # owned by the image's user, as the files its commands make
            assert (await s.exec("echo b >> sub/w.txt && cat sub/w.txt && stat -c %u sub")).stdout == "a\nb\n65534\n"
        async with await b.create(spec()) as s:  # a root image: root with docker's capabilities, as before
            r = await s.exec("id -u; grep CapEff /proc/self/status")
            assert r.stdout.split()[0] == "0" and r.stdout.split()[-1] != "0000000000000000", r

    run(go)


def test_a_session_past_its_wall_clock_raises_session_expired() -> None:
    async def go(b: Any) -> None:
        s = await b.create(spec(limits=SessionLimits(session_timeout_s=2, exec_timeout_s=20)))
        r = await s.exec("sleep 30", timeout_s=20)  # capped at the session's own wall clock
        assert r.timed_out, r
        await asyncio.sleep(1.5)
        for call in (s.exec("true"), s.read_file("x"), s.write_file("x", "y"), s.diff()):
            with pytest.raises(SessionExpired):
                await call
        await s.aclose()

    run(go)


# --- 4. whose error -------------------------------------------------------------------------------------------------

def test_bad_paths_and_large_files_are_the_callers_errors_not_the_engines() -> None:
    async def go(b: Any) -> None:
        async with await b.create(spec()) as s:
            calls: list[Awaitable[Any]] = [
                s.read_file("a\x00b"), s.write_file("a\x00b", "x"), s.exec("true", cwd="/tmp\x00x"),
                s.exec("echo a\x00b"), s.exec(["echo", "a\x00b"]), s.exec("true", env={"A\x00": "1"}),
                s.exec("true", env={"A": "1\x00"}), s.exec("true", env={"A=B": "1"}),
                s.read_file(123),  # type: ignore[arg-type]
            ]
            for c in calls:
                with pytest.raises(SessionError) as e:
                    await c
                assert not isinstance(e.value, SessionInfraError), e.value
            with pytest.raises(SessionFileNotFound):
                await s.exec("true", cwd="/no/such/dir")
            await s.exec("head -c 70000000 /dev/zero > big.bin")
            with pytest.raises(SessionError) as e:
                await s.read_file("big.bin")
            assert not isinstance(e.value, SessionInfraError) and "larger" in str(e.value)
            assert (await s.exec("echo still fine")).stdout == "still fine\n"

    run(go)


def test_a_container_killed_from_outside_is_an_infrastructure_failure(client: Any) -> None:
    async def go(b: Any) -> None:
        s = await b.create(spec())
        try:
            await asyncio.to_thread(client.containers.get(s._c.id).kill)
            await asyncio.sleep(1)
            with pytest.raises(SessionInfraError):
                await s.exec("true")
            for call in (s.read_file("x"), s.write_file("d/x", "y"), s.diff()):  # not "no such file"
                with pytest.raises(SessionInfraError):
                    await call
        finally:
            await s.aclose()

    run(go)


def test_diff_max_bytes_refuses_a_large_patch_before_building_it(tmp_path: Path) -> None:
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "a.txt").write_text("a\n")

    async def go(b: Any) -> None:
        async with await b.create(spec(seed_dir=str(seed))) as s:
            await s.exec("echo b >> a.txt")
            small = await s.diff()
            assert "+b" in small and small == await s.diff(max_bytes=len(small.encode()))
            with pytest.raises(SessionDiffTooLarge) as e:
                await s.diff(max_bytes=len(small.encode()) - 1)
            assert e.value.limit == "diff_bytes"
            await s.exec("mkdir many && cd many && for i in $(seq 3000); do : > f$i; done")
            with pytest.raises(SessionDiffTooLarge):  # refused from the archive's names alone
                await s.diff(max_bytes=10000)
            await s.exec("rm -rf many; head -c 300000000 /dev/urandom > huge.bin")
            with pytest.raises(SessionDiffTooLarge):  # more than the diff reads at all
                await s.diff()
            await s.exec("rm huge.bin")
            assert await s.diff() == small

    run(go)


def test_a_pathological_diff_costs_the_session_not_the_trainer(tmp_path: Path) -> None:
    """difflib is quadratic on alternating changed lines (20,000 lines: ~25 s of CPU): the diff runs in a child under
    a CPU limit of exec_timeout_s, so it is the policy's failure (SessionDiffTooLarge) soon, not minutes of the
    trainer's CPU and GIL."""
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "big.txt").write_text("".join(f"l{i}\n" for i in range(20000)))

    async def go(b: Any) -> None:
        lim = SessionLimits(exec_timeout_s=2, session_timeout_s=300, memory_mb=512, pids=128, disk_mb=64)
        async with await b.create(spec(seed_dir=str(seed), limits=lim)) as s:
            await s.exec("awk 'NR % 2 { print \"x\" NR; next } { print }' big.txt > t && mv t big.txt")
            t0 = time.monotonic()
            with pytest.raises(SessionDiffTooLarge, match="CPU"):
                await s.diff()
            assert time.monotonic() - t0 < 60

    run(go)


def test_a_workdir_swapped_for_a_link_to_a_host_path_leaks_nothing(tmp_path: Path) -> None:
    """The diff unpacks the workdir on the host: a workdir replaced by a link (here to a host directory the session
    guessed) must not be followed there, nor a link inside it."""
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "secret.txt").write_text("TOPSECRET\n")

    async def go(b: Any) -> None:
        async with await b.create(spec()) as s:
            await s.exec(f"ln -s {canary} inner && ln -s {canary}/secret.txt f")
            patch = await s.diff()
            assert "TOPSECRET" not in patch and f"+{canary}" in patch, patch  # links, as links
            await s.exec(f"rm -rf /workspace && ln -s {canary} /workspace", cwd="/")
            with pytest.raises(SessionError) as e:
                await s.diff()
            assert not isinstance(e.value, SessionInfraError) and "no longer a directory" in str(e.value)

    run(go)


# --- 3. Harbor images -----------------------------------------------------------------------------------------------

def _task(d: Path, run_line: str = "RUN echo build-log-line-$((40 + 2))") -> Any:
    from rlf_envs.tasks.harbor import load_harbor_task

    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "instruction.md").write_text("Do it.\n")
    (d / "task.toml").write_text(f'version = "1.0"\n[metadata]\nname = "hardening-{uuid.uuid4().hex[:6]}"\n'
                                 '[environment]\nbuild_timeout_sec = 120.0\n')
    (d / "environment" / "Dockerfile").write_text(f"ARG BASE_IMAGE\nFROM ${{BASE_IMAGE}}\nCOPY uniq.txt /\n"
                                                  f"{run_line}\n")
    (d / "environment" / "uniq.txt").write_text(uuid.uuid4().hex)  # a content hash of its own
    (d / "tests" / "test.sh").write_text("exit 0\n")
    return load_harbor_task(d)


def _exists(client: Any, ref: str) -> bool:
    try:
        client.images.get(ref.removeprefix("docker:"))
        return True
    except Exception:
        return False


def test_harbor_build_logs_stay_off_stdout_and_its_image_leaves_with_the_backend(
        tmp_path: Path, client: Any, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rlf_envs.tasks.harbor import HarborError, build_docker_image

    monkeypatch.delenv("RLF_KEEP_DOCKER_IMAGES", raising=False)
    dangling = [i.id for i in client.images.list(all=True) if not i.tags]
    caplog.set_level(logging.DEBUG, logger="rlf_envs.tasks.harbor")
    ref = build_docker_image(_task(tmp_path / "a"), {"BASE_IMAGE": IMAGE})
    assert build_docker_image(_task(tmp_path / "a2"), {"BASE_IMAGE": IMAGE}) != ref
    out, err = capfd.readouterr()
    assert "build-log-line" not in out + err and out == "", (out, err)
    assert "build-log-line-42" in caplog.text  # at debug level
    assert _exists(client, ref)

    async def use(b: Any) -> None:
        async with await b.create(SessionSpec(image=ref, limits=FAST)) as s:
            assert (await s.exec("echo ok")).stdout == "ok\n"

    run(use)
    assert not _exists(client, ref), "an image the run built is removed when the backend closes"

    monkeypatch.setenv("RLF_KEEP_DOCKER_IMAGES", "1")
    task = _task(tmp_path / "b")
    kept = build_docker_image(task, {"BASE_IMAGE": IMAGE})
    try:
        async def use_kept(b: Any) -> None:
            async with await b.create(SessionSpec(image=kept, limits=FAST)) as s:
                assert (await s.exec("echo ok")).stdout == "ok\n"

        run(use_kept)  # a backend opened, a session of the kept image (pid 1 derived from it), closed
        assert _exists(client, kept), "RLF_KEEP_DOCKER_IMAGES=1 keeps them (reused by content hash)"
        from rlf_envs.sandbox.sessions.docker import INIT_LABEL

        assert not client.images.list(filters={"label": INIT_LABEL}), "the derived pid-1 image is not kept with it"
        caplog.clear()
        assert build_docker_image(task, {"BASE_IMAGE": IMAGE}) == kept
        assert "docker build" not in caplog.text  # reused, not rebuilt
    finally:
        client.images.remove(kept.removeprefix("docker:"), force=True)

    with pytest.raises(HarborError, match=r"(?s)failed.*exit-seven"):  # the log's tail is in the error
        build_docker_image(_task(tmp_path / "c", "RUN echo exit-seven && exit 7"), {"BASE_IMAGE": IMAGE})
    out, err = capfd.readouterr()
    assert "exit-seven" not in out + err
    assert [i.id for i in client.images.list(all=True) if not i.tags] == dangling  # nor step images left behind


BUILDER = textwrap.dedent("""
    import os, sys
    from rlf_envs.tasks.harbor import build_docker_image, load_harbor_task
    print(build_docker_image(load_harbor_task(sys.argv[1]), {"BASE_IMAGE": os.environ["IMG"]}), flush=True)
    os._exit(0)  # gone without closing anything
""")


def test_an_image_built_by_a_process_that_died_is_reaped(tmp_path: Path, client: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLF_KEEP_DOCKER_IMAGES", raising=False)
    _task(tmp_path / "t")
    env = {**os.environ, "IMG": IMAGE, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("RLF_KEEP_DOCKER_IMAGES", None)
    ref = subprocess.run([sys.executable, "-c", BUILDER, str(tmp_path / "t")], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout.strip()
    assert ref.startswith("docker:rlf-harbor-") and _exists(client, ref)
    n = run(lambda b: asyncio.sleep(0, b.reaped_at_start))
    assert n >= 1 and not _exists(client, ref)
