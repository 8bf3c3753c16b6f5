"""rlf's stdio transport for MCP servers: a contained process tree and bounded replies.

Used instead of the SDK's `stdio_client` (same wire protocol: newline-delimited JSON-RPC) because:

- **Containment.** The server leads its own session and process group; when the session ends (close,
  restart, crash, interpreter exit) the whole tree is ended (`procs.kill_tree`): children started by the
  server, grandchildren that moved to another group, and anything still holding the server's pipes. The
  SDK kills the tree only if the server itself does not exit within 2 s of stdin closing, so a
  well-behaved server's children outlived it. The leader's exit is watched directly (a child holding the
  stdout pipe would otherwise hide a crash: no EOF ever comes).
- **Bounded replies.** Lines are split in linear time and a reply larger than `max_reply_bytes` is
  discarded as it streams in (never buffered or parsed); the request it answered gets a JSON-RPC error
  saying so, when its id can be read from the reply's first or last bytes, else the session is ended (and
  restarted on the next call). Large replies are parsed on a worker thread, so the event loop keeps
  serving other envs. The SDK joined each 64 KB chunk to the whole line so far (quadratic: a 50 MB reply
  stalled the loop for ~10 s) and parsed it on the loop.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import re
import subprocess
import threading
import time
from types import TracebackType
from typing import Any

import anyio
import mcp_types as types
from mcp.client.stdio import get_default_environment
from mcp.shared.message import SessionMessage

from rlf_envs.tools.procs import kill_tree

log = logging.getLogger(__name__)

#: replies longer than this are parsed on a worker thread instead of on the loop
PARSE_IN_THREAD_BYTES = 256 << 10
#: JSON-RPC error code for a reply over `max_reply_bytes` (implementation-defined server error range)
REPLY_TOO_LARGE = -32099
_CHUNK = 1 << 16
_EDGE = 512  # bytes kept from an oversize reply's start and end to find its id
_ID_AT_START = re.compile(rb'^\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"id"\s*:\s*(-?\d{1,18}|"[^"\\]{0,200}")')
_ID_AT_END = re.compile(rb'"id"\s*:\s*(-?\d{1,18}|"[^"\\]{0,200}")\s*(?:,\s*"jsonrpc"\s*:\s*"2\.0"\s*)?\}\s*$')

# live server process groups, ended at interpreter exit if nothing closed them before (a last resort)
_live: dict[int, tuple[int, ...]] = {}
_live_lock = threading.Lock()


@atexit.register
def _end_leftover_trees() -> None:
    with _live_lock:
        trees = list(_live.items())
        _live.clear()
    for leader, inodes in trees:
        kill_tree(leader, inodes, grace_s=0.2, wait_s=1.0)


def _reply_id(head: bytes, tail: bytes) -> int | str | None:
    """The id of a JSON-RPC reply from its first or last bytes, only where it is surely the top-level id."""
    m = _ID_AT_START.match(head) or _ID_AT_END.search(tail)
    if m is None:
        return None
    raw = m.group(1)
    return raw[1:-1].decode("utf-8", "replace") if raw.startswith(b'"') else int(raw)


class BoundedStdioTransport:
    """An MCP `Transport` (async context manager giving the session's read and write streams)."""

    def __init__(
        self,
        command: str,
        args: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        max_reply_bytes: int = 4 << 20,
        grace_s: float = 1.0,
    ) -> None:
        self.command = command
        self.args = list(args)
        self.env = env
        self.cwd = cwd
        self.max_reply_bytes = max_reply_bytes
        self.grace_s = grace_s
        self.proc: subprocess.Popen[bytes] | None = None
        #: when the reply now being received started arriving (None between replies)
        self.partial_since: float | None = None
        self.oversize_replies = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._inodes: tuple[int, ...] = ()
        self._ending: asyncio.Future[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------------------
    async def __aenter__(self) -> tuple[Any, Any]:
        loop = asyncio.get_running_loop()
        # our own pipes (not the loop's subprocess transport: uvloop uses socket pairs, whose far end we could
        # not recognise in another process), so that whatever inherits them can be found and ended
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            self.proc = proc = subprocess.Popen(
                [self.command, *self.args],
                stdin=to_child_r,
                stdout=from_child_w,
                env=get_default_environment() | (self.env or {}),
                cwd=self.cwd,
                start_new_session=True,  # its own session and process group: ended as a whole
            )
        except BaseException:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.close(to_child_r)
                os.close(from_child_w)
        self._inodes = (os.fstat(to_child_w).st_ino, os.fstat(from_child_r).st_ino)
        with _live_lock:
            _live[proc.pid] = self._inodes
        try:
            self._stdout = asyncio.StreamReader(limit=_CHUNK, loop=loop)
            await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(self._stdout, loop=loop), os.fdopen(from_child_r, "rb", 0)
            )
            transport, protocol = await loop.connect_write_pipe(
                lambda: asyncio.streams.FlowControlMixin(loop=loop), os.fdopen(to_child_w, "wb", 0)
            )
            self._stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        except BaseException:
            await asyncio.shield(self._end_tree())
            raise
        self._to_session, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        write_stream, self._from_session = anyio.create_memory_object_stream[SessionMessage](0)
        self._streams = (read_stream, write_stream)
        self._tasks = [
            loop.create_task(self._read(), name=f"mcp-stdio-read:{proc.pid}"),
            loop.create_task(self._write(), name=f"mcp-stdio-write:{proc.pid}"),
            loop.create_task(self._watch(), name=f"mcp-stdio-watch:{proc.pid}"),
        ]
        return read_stream, write_stream

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        proc = self.proc
        if proc is None:
            return
        try:
            with contextlib.suppress(Exception):
                self._stdin.close()
            # a polite server exits when its stdin closes; its children are ended either way
            deadline = time.monotonic() + self.grace_s
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.shield(self._end_tree())
        finally:
            for t in self._tasks:
                t.cancel()
            for s in (*self._streams, self._to_session, self._from_session):
                with contextlib.suppress(Exception):
                    await s.aclose()

    def _end_tree(self) -> asyncio.Future[None]:
        """End the server's process tree (once; later callers wait for the same)."""
        if self._ending is None:
            self._ending = asyncio.ensure_future(self._kill())
        return self._ending

    async def _kill(self) -> None:
        proc = self.proc
        assert proc is not None
        with _live_lock:
            _live.pop(proc.pid, None)
        left = await asyncio.to_thread(kill_tree, proc.pid, self._inodes, 0.3, 2.0)
        if left:
            log.warning("MCP server %s (pid %d): processes %s survived SIGKILL", self.command, proc.pid, left)
        with contextlib.suppress(Exception):
            self._stdin.close()
        with contextlib.suppress(Exception):
            self._stdout.feed_eof()
        deadline = time.monotonic() + 2
        while proc.poll() is None and time.monotonic() < deadline:  # reap the leader
            await asyncio.sleep(0.01)

    # -- pipes ----------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """The leader exited (crash, or exit): end its tree now, which also ends the pipes (EOF for the
        reader) even if a child was holding them open."""
        proc = self.proc
        assert proc is not None
        while proc.poll() is None:
            await asyncio.sleep(0.05)
        await self._end_tree()

    async def _write(self) -> None:
        stdin = self._stdin
        try:
            async with self._from_session:
                async for message in self._from_session:
                    try:
                        data = message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    except Exception as e:  # e.g. arguments holding a lone surrogate: that request fails alone
                        await self._refuse(message, e)
                        continue
                    stdin.write(data.encode("utf-8", "replace") + b"\n")
                    await stdin.drain()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError, RuntimeError):
            with contextlib.suppress(Exception):
                await self._to_session.aclose()  # the session sees the connection end

    async def _refuse(self, message: SessionMessage, exc: Exception) -> None:
        rid = getattr(message.message, "id", None)
        if rid is None:
            return
        err = types.ErrorData(code=types.INVALID_PARAMS, message=f"the request could not be encoded: {exc}"[:300])
        await self._to_session.send(SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=rid, error=err)))

    def partial_reply_started(self) -> float | None:
        """When the reply now arriving started (None between replies)."""
        return self.partial_since

    async def _read(self) -> None:
        stdout = self._stdout
        limit = self.max_reply_bytes
        buf = bytearray()
        oversize = 0  # > 0: discarding an oversize reply, this many bytes so far
        head = tail = b""
        try:
            async with self._to_session:
                while True:
                    chunk = await stdout.read(_CHUNK)
                    if not chunk:
                        return
                    pos = 0
                    while pos < len(chunk):
                        if self.partial_since is None:
                            self.partial_since = time.monotonic()
                        nl = chunk.find(b"\n", pos)
                        piece = chunk[pos:] if nl < 0 else chunk[pos:nl]
                        pos = len(chunk) if nl < 0 else nl + 1
                        if oversize:
                            oversize += len(piece)
                            tail = (tail + piece)[-_EDGE:]
                        else:
                            buf += piece
                            if len(buf) > limit:
                                oversize, head, tail = len(buf), bytes(buf[:_EDGE]), bytes(buf[-_EDGE:])
                                buf = bytearray()
                        if nl < 0:
                            break
                        self.partial_since = None
                        if oversize:
                            if not await self._deliver_oversize(head, tail, oversize):
                                return
                            oversize = 0
                        elif buf.strip():
                            line = bytes(buf)
                            buf.clear()
                            await self._to_session.send(await self._parse(line))
                        else:
                            buf.clear()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, ConnectionError, OSError):
            pass
        finally:
            self.partial_since = None

    async def _parse(self, line: bytes) -> SessionMessage | Exception:
        try:
            if len(line) > PARSE_IN_THREAD_BYTES:
                msg = await asyncio.to_thread(types.jsonrpc_message_adapter.validate_json, line, by_name=False)
            else:
                msg = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        except ValueError as e:
            return ValueError(f"MCP server sent a malformed message: {str(e)[:300]}")
        return SessionMessage(msg)

    async def _deliver_oversize(self, head: bytes, tail: bytes, size: int) -> bool:
        """Answer the request of an oversize reply with an error; False when its id cannot be read (the
        session then ends: a request would otherwise wait for its reply until the deadline)."""
        self.oversize_replies += 1
        rid = _reply_id(head, tail)
        log.warning("MCP server %s sent a reply of %d bytes (max_reply_bytes=%d): dropped", self.command, size,
                    self.max_reply_bytes)
        if rid is None:
            return False
        err = types.JSONRPCError(
            jsonrpc="2.0",
            id=rid,
            error=types.ErrorData(
                code=REPLY_TOO_LARGE,
                message=f"the server's reply was {size:,} bytes, over the limit of {self.max_reply_bytes:,} "
                f"bytes (max_reply_bytes); ask for less output",
            ),
        )
        await self._to_session.send(SessionMessage(err))
        return True
