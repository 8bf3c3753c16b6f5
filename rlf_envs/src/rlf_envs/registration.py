"""Gymnasium ids: `rlf/Calculator-v0`, `rlf/Tools-v0`, `rlf/Search-v0`, `rlf/SQL-v0`, `rlf/Code-v0`,
`rlf/SWE-v0` (env and vector entry points), and the ids of every installed env package.

An env package is any distribution that declares an entry point in the group `rlf_envs.envs`; its name is the
package's id namespace and its value a mapping of env id -> "module:Class" (or a function that registers ids
itself, e.g. with `register_env`)::

    [project.entry-points."rlf_envs.envs"]
    myenv = "my_rlf_env:ENVS"          # ENVS = {"myenv/Arithmetic-v0": "my_rlf_env.env:ArithmeticEnv"}

`import rlf_envs` registers them all (gymnasium 1.x loads no plugins itself), so once such a package is installed,
`gymnasium.make("myenv/Arithmetic-v0")` and `python -m rlf_envs.eval --env myenv/Arithmetic-v0` need no import
of the package. A broken package is skipped with a warning; it never breaks `import rlf_envs`.
"""

from __future__ import annotations

import difflib
import inspect
import re
import warnings
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import gymnasium as gym

ENVS = {
    "rlf/Calculator-v0": "rlf_envs.envs.calculator:CalculatorEnv",
    "rlf/Tools-v0": "rlf_envs.envs.demo:ToolsEnv",
    "rlf/Search-v0": "rlf_envs.envs.search:SearchEnv",
    "rlf/SQL-v0": "rlf_envs.envs.sql:SqlEnv",
    "rlf/Code-v0": "rlf_envs.envs.code:CodeEnv",
    "rlf/SWE-v0": "rlf_envs.envs.swe.env:SweEnv",
}
ENTRY_POINT_GROUP = "rlf_envs.envs"
#: env id -> the env package (distribution name) that registered it
PACKAGE_ENVS: dict[str, str] = {}


def _vector_entry(entry: str) -> Any:
    def make_vec(num_envs: int = 1, **kwargs: Any) -> Any:
        from rlf_envs.env.vector import make_tool_vector_env

        mod, cls = entry.split(":")
        env_cls = getattr(__import__(mod, fromlist=[cls]), cls)
        return make_tool_vector_env(num_envs=num_envs, env_cls=env_cls, **kwargs)

    return make_vec


def register_env(env_id: str, entry: str) -> None:
    """Register `env_id` for `gymnasium.make` (entry "module:Class", imported on first make) and
    `gymnasium.make_vec` (rlf's ToolVectorEnv: N envs on one event loop). An id already registered is kept."""
    if ":" not in entry:
        raise ValueError(f"{env_id}: entry point {entry!r} must be 'module:Class'")
    if env_id in gym.registry:
        return
    gym.register(id=env_id, entry_point=entry, vector_entry_point=_vector_entry(entry), disable_env_checker=True)


def _named(params: Any) -> set[str]:
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}


def env_options(env_id: str) -> set[str] | None:
    """The keyword names `gymnasium.make(env_id, ...)` can pass to the env (None: not known). A class whose
    `__init__` takes `**kwargs` and hands them to `super().__init__(...)` (rlf's envs, on to ToolEnv) takes its
    base's names too; one that keeps `**kwargs` for itself takes anything, and nothing is checked."""
    try:
        entry = gym.spec(env_id).entry_point
        fn = gym.envs.registration.load_env_creator(entry) if isinstance(entry, str) else entry
        if fn is None:
            return None
        if not isinstance(fn, type):
            params = inspect.signature(fn).parameters.values()
            return None if any(p.kind is p.VAR_KEYWORD for p in params) else _named(params)
        names: set[str] = set()
        for klass in fn.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            if klass is object:
                return None
            params = inspect.signature(init).parameters.values()
            names |= _named(params)
            var = [p.name for p in params if p.kind is p.VAR_KEYWORD]
            if not var:
                return names
            src = inspect.getsource(init)
            if not re.search(rf"super\(\)\.__init__\(.*\*\*{var[0]}\b", src):
                return None  # its **kwargs stay with it
    except (gym.error.Error, ImportError, AttributeError, TypeError, ValueError, OSError):
        return None
    return None


def check_env_kwargs(env_id: str, kwargs: Mapping[str, Any], where: str = "env kwargs") -> None:
    """A ValueError, on one line, naming each key of `kwargs` that `env_id` does not take (with the nearest key it
    does take) and the keys it takes; nothing is made."""
    accepted = env_options(env_id)
    if accepted is None:
        return
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        parts = []
        for k in unknown:
            near = difflib.get_close_matches(k, sorted(accepted), n=1)
            parts.append(f"{k!r} is not an option of {env_id}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        raise ValueError(f"{where}: {', '.join(parts)}; accepted: {', '.join(sorted(accepted))}")


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An env constructor's error as one short line, without the kwargs gymnasium appends (a tokenizer's repr)."""
    text = " ".join(str(e).split(" was raised from the environment creator")[0].split())
    return f"{type(e).__name__}: {text[:limit] + ' ...' if len(text) > limit else text}"


def make_tool_env(env_id: str, tokenizer: Any = None, **env_kwargs: Any) -> Any:
    """`gymnasium.make(env_id, tokenizer=..., **env_kwargs)` unwrapped to the rlf ToolEnv it must be (any
    registered id: rlf's own or an installed env package's); a tokenizer puts it in token mode. Bad ids and
    kwargs are a ValueError naming the id, on one line (a misspelt key: with the nearest accepted one)."""
    from rlf_envs.env.tool_env import ToolEnv

    register_envs()
    if env_id not in gym.registry:
        near = difflib.get_close_matches(env_id, list(gym.registry), n=3)
        raise ValueError(f"env id {env_id!r} is not registered" + (f" (did you mean {', '.join(near)}?)" if near
                         else "; install the env package that provides it"))
    check_env_kwargs(env_id, env_kwargs)
    kwargs = dict(env_kwargs)
    if tokenizer is not None:
        kwargs["tokenizer"] = tokenizer
    try:
        env = gym.make(env_id, disable_env_checker=True, **kwargs).unwrapped
    except (gym.error.Error, TypeError, ValueError, KeyError, LookupError) as e:
        raise ValueError(f"env id {env_id!r} with {dict(env_kwargs)}: {_one_line(e)}") from None
    if not isinstance(env, ToolEnv):
        raise ValueError(f"env id {env_id!r} makes a {type(env).__name__}, not an rlf ToolEnv")
    return env


_packages_loaded = False


def register_envs() -> None:
    """rlf's ids and (once per process) the installed env packages'."""
    global _packages_loaded
    for env_id, entry in ENVS.items():
        register_env(env_id, entry)
    if not _packages_loaded:
        _packages_loaded = True
        load_env_packages()


def _register_package(ep: EntryPoint) -> list[str]:
    """Register one entry point's ids; raises ValueError for what the package got wrong."""
    target = ep.load()
    if callable(target) and not isinstance(target, Mapping):
        before = set(gym.registry)
        target()
        return sorted(set(gym.registry) - before)
    if not isinstance(target, Mapping):
        raise ValueError(f"{ep.value} is a {type(target).__name__}; it must be a mapping of env id -> "
                         "'module:Class' or a function that registers ids")
    ids = []
    for env_id, entry in target.items():
        if not isinstance(env_id, str) or not env_id.startswith(f"{ep.name}/"):
            raise ValueError(f"env id {env_id!r} must be in the package's namespace: '{ep.name}/<Name>-v<N>'")
        if env_id in gym.registry:
            raise ValueError(f"env id {env_id!r} is already registered (by {PACKAGE_ENVS.get(env_id, 'another')}"
                             " package)")
        if not isinstance(entry, str):
            raise ValueError(f"{env_id}: entry point must be a 'module:Class' string, got {type(entry).__name__}")
        register_env(env_id, entry)
        ids.append(env_id)
    return ids


def load_env_packages(eps: Callable[[], Any] | None = None) -> dict[str, list[str]]:
    """Register the envs of every installed env package (entry-point group `rlf_envs.envs`); returns entry
    point name -> the ids it registered. A package that fails is skipped with a warning naming it."""
    found = (eps or (lambda: entry_points(group=ENTRY_POINT_GROUP)))()
    out: dict[str, list[str]] = {}
    for ep in found:
        dist = getattr(getattr(ep, "dist", None), "name", None) or ep.value
        if ep.name == "rlf":
            warnings.warn(f"env package {dist}: the namespace 'rlf' is rlf's own; its entry point is skipped",
                          stacklevel=2)
            continue
        try:
            ids = _register_package(ep)
        except Exception as e:  # a third party's bug must not break `import rlf_envs`
            warnings.warn(f"env package {dist} (entry point {ep.name} = {ep.value}) was not registered: "
                          f"{type(e).__name__}: {e}", stacklevel=2)
            continue
        for env_id in ids:
            PACKAGE_ENVS[env_id] = dist
        out[ep.name] = ids
    return out
