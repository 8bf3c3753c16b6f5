"""The trusted test harness: tests run here, in the supervisor, against proxies of the solution's names; plain data
over a pipe, decoded strictly, and no exception of the solution's arrives as control flow.

Stdlib only, like every module the supervisor loads: it runs with a bare interpreter (see `_supervisor`).
"""

from __future__ import annotations

import base64
import builtins
import json
import os
import sys
import time
import types
from typing import Any

from rlf_envs.sandbox._base import MAX_REPLY_BYTES, Deadline, SolutionDied, SolutionError
from rlf_envs.sandbox._workerproc import Worker

# ------------------------------------------------------------------------------ tests: trusted harness
#
# The tests run HERE, in the trusted supervisor; the solution runs in the worker. Each name the solution
# defines is a `Remote` proxy; calling it sends plain data to the worker and plain data comes back. Values
# are decoded strictly (JSON with type tags), so the test compares real ints/strs/lists built here: a
# returned object with a rigged __eq__ stays in the worker and compares unequal to any plain value.


class Channel:
    def __init__(self, w: Worker, req_fd: int, rep_fd: int, deadline: float) -> None:
        self.w, self.req, self.rep, self.deadline = w, req_fd, rep_fd, deadline
        self.buf = bytearray()
        os.set_blocking(rep_fd, False)

    def request(self, msg: dict[str, Any]) -> Any:
        if not self.w.alive():
            raise SolutionDied("the solution's process has exited")
        data = (json.dumps(msg) + "\n").encode()
        try:
            os.write(self.req, data)  # requests are small; the pipe buffer holds them
        except (BrokenPipeError, BlockingIOError):
            raise SolutionDied("the solution's process stopped reading") from None
        reply = self._read_line()
        if not isinstance(reply, dict) or len(reply) != 1:
            raise SolutionError("malformed reply from the solution's process")
        if "ok" in reply:
            return decode(reply["ok"], self)
        err = reply.get("err")
        if not (isinstance(err, list) and len(err) == 2 and all(isinstance(x, str) for x in err)):
            raise SolutionError("malformed reply from the solution's process")
        raise _exception(err[0], err[1][:2000], iteration=msg.get("op") == "op" and msg.get("name") == "next")

    def _read_line(self) -> Any:
        while True:
            nl = self.buf.find(b"\n")
            if nl >= 0:
                line = bytes(self.buf[:nl])
                del self.buf[: nl + 1]
                try:
                    return json.loads(line)
                except (ValueError, RecursionError):
                    raise SolutionError("undecodable reply from the solution's process") from None
            if len(self.buf) > MAX_REPLY_BYTES:
                raise SolutionError(f"reply larger than {MAX_REPLY_BYTES} bytes")
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise Deadline()
            if self.w.capture.pump(min(left, 0.05), extra=self.rep):
                try:
                    chunk = os.read(self.rep, 1 << 16)
                except BlockingIOError:
                    continue
                if not chunk:
                    raise SolutionDied("the solution's process closed its reply channel or exited")
                self.buf += chunk
            elif not self.w.alive():
                raise SolutionDied(f"the solution's process exited (status {self.w.proc.returncode})")
            if self.w.capture.overflow:
                raise SolutionDied("output limit exceeded")


#: exceptions that steer control flow: raised inside `all(map(f, xs))`, `next(it, default)`, `sum(...)`, a `for`
#: loop or a generator, a StopIteration ends the iteration early (so `all` of nothing passes), the others unwind the
#: harness itself. A solution's never arrives as one of them (`_exception`): it is a `SolutionRaised` instead.
CONTROL_FLOW = frozenset({"StopIteration", "StopAsyncIteration", "GeneratorExit", "KeyboardInterrupt", "SystemExit"})
_BUILTIN_EXC = {n: e for n, e in vars(builtins).items()
                if isinstance(e, type) and issubclass(e, Exception) and n not in CONTROL_FLOW}


class SolutionRaised(SolutionError):
    """The solution raised an exception that the tests must not see as itself (control flow, see CONTROL_FLOW);
    `name` is its type's name, and the message starts with it."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


def _exception(name: str, message: str, iteration: bool = False) -> BaseException:
    """The test-side exception for one the solution raised (`name`, `message`): the builtin of that name where it
    carries no control flow, else a SolutionError. `iteration`: the reply to `next()` on a solution's iterator,
    whose StopIteration is the iterator protocol's own end (the only place one is passed on as itself)."""
    if iteration and name == "StopIteration":
        return StopIteration(message)
    exc = _BUILTIN_EXC.get(name)
    if exc is None:
        return SolutionRaised(name, message)
    for cls in exc.__mro__:  # (UnicodeDecodeError, ExceptionGroup: not made from one message; their base classes are)
        if cls is not BaseException and issubclass(cls, Exception) and cls.__name__ not in CONTROL_FLOW:
            try:
                return cls(message)
            except TypeError:
                continue
    return SolutionRaised(name, message)


def decode(v: Any, ch: Channel, depth: int = 0) -> Any:
    if depth > 200:
        raise SolutionError("reply nested too deeply")
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is list:
        return [decode(x, ch, depth + 1) for x in v]
    if type(v) is dict and len(v) == 1:
        (tag, x), = v.items()
        if tag == "h" and type(x) is int:
            return Remote(x, ch)
        if tag == "b" and type(x) is str:
            return base64.b64decode(x)
        if type(x) is list:
            items = [decode(i, ch, depth + 1) for i in x]
            if tag == "t":
                return tuple(items)
            if tag == "s":
                return set(items)
            if tag == "f":
                return frozenset(items)
            if tag == "d" and all(type(p) is list and len(p) == 2 for p in items):
                return {k: val for k, val in items}
            if tag == "c" and len(items) == 2:
                return complex(items[0], items[1])
    raise SolutionError("malformed value from the solution's process")


_TAGS: dict[type, str] = {tuple: "t", set: "s", frozenset: "f"}


def encode(v: Any, depth: int = 0) -> Any:
    """Test-side arguments: plain data and solution objects only."""
    if depth > 200:
        raise ValueError("argument nested too deeply")
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if t is Remote:
        return {"h": object.__getattribute__(v, "_h")}
    if t is list:
        return [encode(x, depth + 1) for x in v]
    if t in _TAGS:
        return {_TAGS[t]: [encode(x, depth + 1) for x in v]}
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"b": base64.b64encode(v).decode()}
    if t is complex:
        return {"c": [v.real, v.imag]}
    raise TypeError(f"a test can pass only plain data (None, bool, int, float, str, bytes, list, tuple, dict, "
                    f"set) or the solution's own objects to the solution, not {t.__name__}")


class Remote:
    """A solution object. Operations on it are answered by the solution; comparing it with a plain value
    is never equal (and ordering raises TypeError), so a rigged __eq__/__lt__ cannot pass a test."""

    __slots__ = ("_ch", "_h")

    def __init__(self, h: int, ch: Channel) -> None:
        object.__setattr__(self, "_h", h)
        object.__setattr__(self, "_ch", ch)

    def _op(self, op: str, *args: Any) -> Any:
        ch = object.__getattribute__(self, "_ch")
        h = object.__getattribute__(self, "_h")
        return ch.request({"op": "op", "h": h, "name": op, "args": encode(list(args))})

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        ch = object.__getattribute__(self, "_ch")
        return ch.request({"op": "getattr", "h": object.__getattribute__(self, "_h"), "name": name})

    def __setattr__(self, name: str, value: Any) -> None:
        self._op("setattr", name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        ch = object.__getattribute__(self, "_ch")
        return ch.request({"op": "call", "h": object.__getattribute__(self, "_h"), "args": encode(list(args)),
                           "kwargs": encode(kwargs)})

    def _cmp(self, op: str, other: Any) -> Any:
        return self._op(op, other) if type(other) is Remote else NotImplemented

    def __eq__(self, other: object) -> Any:
        return self._cmp("eq", other)

    def __ne__(self, other: object) -> Any:
        return self._cmp("ne", other)

    def __lt__(self, other: Any) -> Any:
        return self._cmp("lt", other)

    def __le__(self, other: Any) -> Any:
        return self._cmp("le", other)

    def __gt__(self, other: Any) -> Any:
        return self._cmp("gt", other)

    def __ge__(self, other: Any) -> Any:
        return self._cmp("ge", other)

    __hash__ = object.__hash__

    def __len__(self) -> int:
        n = self._op("len")
        if type(n) is not int:
            raise TypeError("len() of a solution object did not return an int")
        return n

    def __bool__(self) -> bool:
        return self._op("bool") is True

    def __iter__(self) -> Any:
        return self._op("iter")

    def __next__(self) -> Any:
        return self._op("next")

    def __getitem__(self, key: Any) -> Any:
        return self._op("getitem", key)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._op("setitem", key, value)

    def __delitem__(self, key: Any) -> None:
        self._op("delitem", key)

    def __contains__(self, item: Any) -> bool:
        return self._op("contains", item) is True

    def __repr__(self) -> str:
        try:
            r = self._op("repr")
        except Exception:
            return "<solution object>"
        return r if type(r) is str else "<solution object>"

    __str__ = __repr__


#: stdlib modules a solution's name may shadow that are not imported here to stand in for it (side effects)
_NOT_IMPORTED = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "webbrowser"})


def _test_namespace(names: dict[Any, Any]) -> dict[str, Any]:
    """The tests' globals: the solution's top-level names (proxies), except that no name of a builtin or of a stdlib
    module resolves to the solution's: `abs`, `len`, `sorted`, `set`, `math`, `re` stay the real ones here, whatever
    the solution defined (its own code, in the worker, still sees its own definitions). A stdlib module's name is
    the real module (imported here) even if the solution bound it to something else. Also the module `solution`
    (`import solution`, `from solution import f`) with all its names; `from solution import *` gets only the ones
    that shadow nothing. A rewritten worker may send any names: dunder names and non-identifiers are dropped."""
    import importlib

    ns: dict[str, Any] = {"__name__": "__test__", "__builtins__": builtins}
    own: dict[str, Any] = {}
    for k, v in names.items():
        if type(k) is not str or not k.isidentifier() or k.startswith("__"):
            continue
        own[k] = v
        if hasattr(builtins, k):
            continue  # the builtin stays (the test can still reach the solution's as solution.<name>)
        if k in sys.stdlib_module_names:
            if k in sys.modules or k not in _NOT_IMPORTED:
                try:
                    ns[k] = importlib.import_module(k)
                except Exception:
                    pass  # (not importable here: the test must import what it uses)
            continue
        ns[k] = v
    module = types.ModuleType("solution")
    module.__dict__.update(own)
    module.__all__ = [k for k in own if k in ns and ns[k] is own[k]]  # type: ignore[attr-defined]
    sys.modules["solution"] = module
    return ns


def _run_tests(ch: Channel, tests: list[str], results: list[bool], errors: list[str]) -> None:
    """Append one verdict per test to `results` (those done stay if the deadline interrupts us)."""
    try:
        ch.request({"op": "load"})
        names = ch.request({"op": "names"})
        if type(names) is not dict:
            raise SolutionError("malformed names")
    except Deadline:
        raise
    except BaseException as e:
        results += [False] * len(tests)
        errors += [f"solution failed to load: {type(e).__name__}: {e}"[:500]] * len(tests)
        return
    ns = _test_namespace(names)
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{i}.py", "exec"), ns)
            results.append(True)
            errors.append("")
        except Deadline:
            raise
        except BaseException as e:
            results.append(False)
            errors.append(f"{type(e).__name__}: {e}"[:500])
