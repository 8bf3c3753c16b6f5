"""Check flags with OpenRLHF's own argument parser and validation, without importing ray, vLLM or DeepSpeed.

`openrlhf.cli.train_ppo_ray` builds its parser and validates the parsed arguments inside
`if __name__ == "__main__":`, after module-level imports of ray and vLLM. We read that block from the
installed file and run it as it is, with `train(args)` replaced by a function that keeps `args`: the
parser, its defaults and choices, and OpenRLHF's own cross-flag assertions are the installed version's,
never a copy of ours.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime
import functools
import importlib.util
import io
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from rlf_envs.errors import RlfError
from rlf_envs.extras import pip_install

MODULE = "openrlhf.cli.train_ppo_ray"
_lock = threading.Lock()


class OpenRLHFFlagError(RlfError, ValueError):
    """OpenRLHF's parser or its validation refused the flags."""


def openrlhf_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("openrlhf")
    except Exception:
        return None


def _main_block(path: Path) -> ast.Module:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
            return ast.Module(body=node.body, type_ignores=[])
    raise OpenRLHFFlagError(f"{path}: no `if __name__ == '__main__':` block; unsupported OpenRLHF version "
                            f"{openrlhf_version()}")


def _scope(train: Any) -> dict[str, Any]:
    """The module globals the entry block uses, with `train` replaced."""
    return {"__name__": "__rlf_check__", "argparse": argparse, "datetime": datetime.datetime, "os": os,
            "train": train}


class _GotParser(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@functools.cache
def openrlhf_options() -> frozenset[str]:
    """Every option string (`--train.async_enable`, ...) of the installed OpenRLHF's `train_ppo_ray` parser,
    read from the same entry block `parse_flags` runs (stopped at its `parse_args`)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"{MODULE} not found: {pip_install('openrlhf', dist='rlf-train')}")
    code = compile(_main_block(Path(spec.origin)), spec.origin, "exec")

    def stop(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _GotParser(self)

    with _lock:
        saved = argparse.ArgumentParser.parse_args
        argparse.ArgumentParser.parse_args = stop  # type: ignore[method-assign]
        try:
            exec(code, _scope(lambda args: None))
        except _GotParser as got:
            return frozenset(o for a in got.parser._actions for o in a.option_strings)
        finally:
            argparse.ArgumentParser.parse_args = saved  # type: ignore[method-assign]
    raise OpenRLHFFlagError(f"{MODULE}: its entry block never called parse_args; unsupported OpenRLHF version "
                            f"{openrlhf_version()}")


def parse_flags(flags: list[str]) -> SimpleNamespace:
    """OpenRLHF's parsed, validated, hierarchical `args` for these flags (what `train(args)` would get).

    Raises OpenRLHFFlagError with OpenRLHF's message when its parser or an assertion refuses them, and
    ModuleNotFoundError when openrlhf is not installed."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"{MODULE} not found: {pip_install('openrlhf', dist='rlf-train')}")
    code = compile(_main_block(Path(spec.origin)), spec.origin, "exec")
    got: list[Any] = []
    scope = _scope(got.append)
    err = io.StringIO()
    with _lock:  # the block reads sys.argv
        saved = sys.argv
        sys.argv = [MODULE, *flags]
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                exec(code, scope)
        except SystemExit as e:
            msg = err.getvalue().strip().splitlines()
            raise OpenRLHFFlagError(msg[-1] if msg else f"OpenRLHF's parser exited with {e.code}") from None
        except AssertionError as e:
            raise OpenRLHFFlagError(f"OpenRLHF refused the flags: {e}") from None
        finally:
            sys.argv = saved
    if not got:
        raise OpenRLHFFlagError("OpenRLHF's entry block did not reach train(args)")
    return got[0]
