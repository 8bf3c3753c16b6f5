"""Verifier configuration: pydantic models selected by a `type` field, a registry, and builders.

Every verifier type has a config model (a `VerifierConfig` subclass with `type: Literal["name"]`)
whose `build(ctx)` returns the `Verifier`. Nested verifier fields use `VerifierSpec`, which looks
the `type` up in the registry at validation time, so user-registered types nest like built-ins::

    @register_verifier
    class LengthPenaltyConfig(VerifierConfig):
        type: Literal["length_penalty"] = "length_penalty"
        max_chars: int = 2000
        def build(self, ctx: BuildContext) -> Verifier:
            return LengthPenalty(self.max_chars)
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeVar

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, SerializeAsAny, ValidationError, model_validator

from rlf_envs.errors import RlfError
from rlf_envs.rewards.base import ToolInvoker, Verifier

_REGISTRY: dict[str, type[VerifierConfig]] = {}


class VerifierConfigError(RlfError, ValueError):
    """A verifier config is invalid. The message names each bad field by its path and says how to fix it."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "") -> None:
        self.problems = problems
        head = f"invalid verifier config{f' in {source}' if source else ''}:"
        super().__init__("\n".join([head, *(f"  {path or '<root>'}: {msg}" for path, msg in problems)]))


@dataclass(slots=True)
class BuildContext:
    """What builders may need beyond the config: the env's tools, for tool-verified verifiers."""

    tools: ToolInvoker | None = None


class VerifierConfig(BaseModel):
    """Base of all verifier configs. `name` prefixes this verifier's entries in `Score.info`;
    `fallback` is the score used when the verifier itself fails (it is logged and counted)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    type: str
    name: str | None = None
    fallback: float = 0.0

    # Field names that may be given in YAML but are not model fields (e.g. aliases).
    _extra_allowed: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _check_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            allowed = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = [k for k in data if k not in allowed]
            if unknown:
                key = str(unknown[0])
                hint = difflib.get_close_matches(key, sorted(allowed), n=1)
                tip = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise ValueError(
                    f"unknown field {key!r}{tip} for verifier type {cls.type_name()!r}; "
                    f"allowed fields: {', '.join(sorted(allowed))}"
                )
        return data

    @classmethod
    def type_name(cls) -> str:
        default = cls.model_fields["type"].default
        return default if isinstance(default, str) else cls.__name__

    def build(self, ctx: BuildContext) -> Verifier:
        """Instantiate the verifier this config describes."""
        raise NotImplementedError(f"{type(self).__name__}.build is not implemented")


C = TypeVar("C", bound=VerifierConfig)


def register_verifier(cls: type[C]) -> type[C]:
    """Class decorator: make a `VerifierConfig` subclass selectable by its `type` literal in YAML/dicts."""
    if not (isinstance(cls, type) and issubclass(cls, VerifierConfig)):
        raise TypeError("register_verifier decorates VerifierConfig subclasses")
    name = cls.model_fields["type"].default
    if not isinstance(name, str) or not name:
        raise TypeError(
            f"{cls.__name__} needs a default for its type field, e.g. type: Literal['my_check'] = 'my_check'"
        )
    existing = _REGISTRY.get(name)
    if existing is not None and existing.__qualname__ != cls.__qualname__:
        owner = f"{existing.__module__}.{existing.__qualname__}"
        raise ValueError(f"verifier type {name!r} is already registered by {owner}; pick another type name")
    _REGISTRY[name] = cls
    return cls


def registered_types() -> list[str]:
    """The verifier type names that configs may use. (The built-in types are registered by the modules that
    define them, which the package `rlf_envs.rewards` imports: Python runs it before this module, so they are
    registered before anything here can be called.)"""
    return sorted(_REGISTRY)


def _dispatch(value: Any) -> Any:
    """Validate a mapping as the config class its `type` names (used for every nested verifier field)."""
    if isinstance(value, VerifierConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"expected a verifier mapping with a 'type' key, got {type(value).__name__}")
    kind = value.get("type")
    allowed = ", ".join(sorted(_REGISTRY))
    if kind is None:
        raise ValueError(f"missing 'type'; allowed types: {allowed}")
    if kind not in _REGISTRY:
        hint = difflib.get_close_matches(str(kind), list(_REGISTRY), n=1)
        tip = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ValueError(f"unknown verifier type {kind!r}{tip}; allowed types: {allowed}")
    return _REGISTRY[kind].model_validate(value)


VerifierSpec = Annotated[SerializeAsAny[VerifierConfig], BeforeValidator(_dispatch)]


def _loc_to_path(loc: tuple[int | str, ...], prefix: str) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path = f"{path}.{part}" if path else str(part)
    return path


def _errors_to_problems(err: ValidationError, prefix: str) -> list[tuple[str, str]]:
    problems = []
    for e in err.errors(include_url=False):
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] not in {"value_error", "missing"} and not isinstance(e.get("input"), dict | list):
            msg = f"{msg} (got {e.get('input')!r})"
        problems.append((_loc_to_path(tuple(e["loc"]), prefix), msg))
    return problems


def parse_verifier_config(
    config: dict[str, Any] | VerifierConfig, *, path: str = "", source: str = ""
) -> VerifierConfig:
    """Validate a mapping into its typed config; raise `VerifierConfigError` naming every bad field."""
    if isinstance(config, VerifierConfig):
        return config
    try:
        return _dispatch(config)
    except ValidationError as e:
        raise VerifierConfigError(_errors_to_problems(e, path), source) from None
    except ValueError as e:
        raise VerifierConfigError([(path or "type", str(e))], source) from None


def build_verifier(
    config: dict[str, Any] | VerifierConfig, *, tools: ToolInvoker | None = None, path: str = "", source: str = ""
) -> Verifier:
    """Build a verifier from a dict (e.g. parsed YAML) or a typed config.

    `tools` is given to tool-verified verifiers (anything with `async call(name, arguments) -> ToolResult`).
    """
    cfg = parse_verifier_config(config, path=path, source=source)
    return cfg.build(BuildContext(tools=tools))


def load_verifier_yaml(path: str | Path, *, key: str | None = "reward", tools: ToolInvoker | None = None) -> Verifier:
    """Build a verifier from a YAML file. If the document is a mapping with `key` (default `reward`),
    that sub-mapping is the verifier config; otherwise the whole document is."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise VerifierConfigError([("", f"cannot read {p}: {e.strerror}")], str(p)) from None
    except yaml.YAMLError as e:
        raise VerifierConfigError([("", f"not valid YAML: {e}")], str(p)) from None
    prefix = ""
    if key and isinstance(data, dict) and key in data and "type" not in data:
        data, prefix = data[key], key
    if not isinstance(data, dict):
        raise VerifierConfigError([(prefix, "expected a mapping with a 'type' key")], str(p))
    return build_verifier(data, tools=tools, path=prefix, source=str(p))


def validate_kwargs(config_cls: type[VerifierConfig], kwargs: dict[str, Any]) -> VerifierConfig:
    """Validate Python keyword arguments with the same rules and messages as YAML."""
    try:
        return config_cls.model_validate({"type": config_cls.type_name(), **kwargs})
    except ValidationError as e:
        raise VerifierConfigError(_errors_to_problems(e, ""), config_cls.type_name()) from None
