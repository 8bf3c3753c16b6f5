"""The untrusted side of a test run: loads the solution and answers the supervisor's requests.

Runs as `python -I -c <this file> REQ_FD REP_FD solution.py` inside the sandbox. Nothing here is trusted:
the solution may rewrite any of it, read both pipes or write anything to them. That is fine by design:
the supervisor only ever accepts plain data as the result of a call it made, and evaluates the tests
itself, so the most a rewritten worker can do is return a value -- which is what a solution does anyway.
"""

import base64
import builtins
import json
import operator
import os
import sys

REQ, REP = int(sys.argv[1]), int(sys.argv[2])
OBJECTS: dict = {}
OPS: dict = {
    "len": len, "bool": bool, "iter": iter, "next": next, "repr": repr, "getitem": operator.getitem,
    "setitem": operator.setitem, "delitem": operator.delitem, "contains": operator.contains,
    "eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
    "ge": operator.ge, "setattr": setattr,
}
TAGS: dict = {tuple: "t", set: "s", frozenset: "f"}
BIG = 10_000


def enc(v, depth=0):
    if depth > 100:
        raise ValueError("value nested too deeply to return")
    t = type(v)
    if v is None or t in (bool, int, float, str):
        return v
    if t is list:
        return [enc(x, depth + 1) for x in v]
    if t in TAGS:
        return {TAGS[t]: [enc(x, depth + 1) for x in v]}
    if t is dict:
        return {"d": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"b": base64.b64encode(v).decode()}
    if t is complex:
        return {"c": [v.real, v.imag]}
    OBJECTS[id(v)] = v
    return {"h": id(v)}


def by_name(v):
    """A top-level name's value: big containers stay here as handles (indexing, len, iteration and `in`
    work through the proxy), so a large lookup table does not have to fit in one reply."""
    if type(v) in (list, tuple, dict, set, frozenset, str, bytes) and len(v) > BIG:
        OBJECTS[id(v)] = v
        return {"h": id(v)}
    return enc(v)


def dec(v):
    if type(v) is list:
        return [dec(x) for x in v]
    if type(v) is dict:
        (tag, x), = v.items()
        if tag == "h":
            return OBJECTS[x]
        if tag == "b":
            return base64.b64decode(x)
        items = [dec(i) for i in x]
        return {"t": tuple, "s": set, "f": frozenset}.get(tag, lambda it: {k: val for k, val in it})(items) \
            if tag != "c" else complex(*items)
    return v


def serve():
    sys.set_int_max_str_digits(0)
    ns = {"__name__": "solution", "__builtins__": builtins}
    sys.modules["solution"] = type(sys)("solution")
    reader = os.fdopen(REQ, "rb")
    for line in reader:
        try:
            m = json.loads(line)
            op = m["op"]
            if op == "load":
                with open(sys.argv[3], encoding="utf-8") as f:
                    src = f.read()
                exec(compile(src, "solution.py", "exec"), ns)
                sys.modules["solution"].__dict__.update(ns)
                reply = None
            elif op == "names":
                reply = {k: by_name(v) for k, v in ns.items() if not k.startswith("__")}
                reply = {"d": [[k, v] for k, v in reply.items()]}
            elif op == "getattr":
                reply = enc(getattr(OBJECTS[m["h"]], m["name"]))
            elif op == "call":
                reply = enc(OBJECTS[m["h"]](*dec(m["args"]), **dec(m["kwargs"])))
            else:
                reply = enc(OPS[m["name"]](OBJECTS[m["h"]], *dec(m["args"])))
            out: dict = {"ok": reply}
        except BaseException as e:  # every failure is the solution's answer
            out = {"err": [type(e).__name__, str(e)[:2000]]}
        try:
            data = json.dumps(out)
        except BaseException as e:
            data = json.dumps({"err": [type(e).__name__, "result could not be encoded"]})
        os.write(REP, (data + "\n").encode())


serve()
