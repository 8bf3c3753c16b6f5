"""rlf envs as the environment layer of other trainers: one small module per trainer, each an optional extra.

Importing this package imports no trainer (and no torch/transformers); each adapter module imports its
trainer lazily and says which extra to install when it is missing. `episode` is the trainer-neutral core:
token-mode episodes driven by any generate function (`run_token_episodes`).

| trainer | module | extra |
|---|---|---|
| TRL (GRPOTrainer) | `rlf_envs.adapters.trl` | `rlf-envs[trl]` |

See docs/integrations/index.md for what each keeps (token exact, per-turn rewards, parallel tools, MCP).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

from rlf_envs.extras import require


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """An adapter: its module, the trainer package it drives (import name), and the rlf-envs extra that
    installs a tested version of that package."""

    module: str
    package: str
    extra: str

    @property
    def install(self) -> str:
        return f"pip install 'rlf-envs[{self.extra}]'"


ADAPTERS: dict[str, AdapterInfo] = {
    "trl": AdapterInfo("rlf_envs.adapters.trl", "trl", "trl"),
    "skyrl": AdapterInfo("rlf_envs.adapters.skyrl", "skyrl_gym", "skyrl"),
    "verl": AdapterInfo("rlf_envs.adapters.verl", "verl", "verl"),
    "nemo_gym": AdapterInfo("rlf_envs.adapters.nemo_gym", "nemo_gym", "nemo-gym"),
    "openenv": AdapterInfo("rlf_envs.adapters.openenv", "openenv", "openenv"),
}


def require_trainer(name: str) -> ModuleType:
    """Import the trainer package of adapter `name`, or raise `rlf_envs.extras.MissingDependency` (an
    ImportError) naming the extra that installs it."""
    info = ADAPTERS[name]
    return require(info.package, info.module)


__all__ = ["ADAPTERS", "AdapterInfo", "require_trainer"]
