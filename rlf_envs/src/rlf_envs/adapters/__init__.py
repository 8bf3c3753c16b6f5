"""rlf envs as the environment layer of other trainers: one small module per trainer, each an optional extra.

Importing this package imports no trainer (and no torch/transformers); each adapter module imports its
trainer lazily and says how to install it when it is missing. They build on the trainer-neutral core,
`rlf_envs.env.episodes`: token-mode episodes driven by any generate function (`run_token_episodes`).

| trainer | module | install |
|---|---|---|
| TRL (GRPOTrainer) | `rlf_envs.adapters.trl` | `pip install -e './rlf_envs[trl]'` (from the checkout's root) |
| verifiers (PrimeIntellect, `verifiers.v1`) | `rlf_envs.adapters.verifiers` (taskset id `rlf_verifiers`) | see below |

verifiers 0.4.0 pins `mcp==2.0.0` and `openai<3`, which rlf-envs cannot use (it needs `mcp>=2.3`), so it has
no extra: `pip install --no-deps verifiers==0.4.0` and its other requirements (docs/integrations/verifiers.md).

See docs/integrations/index.md for what each keeps (token exact, per-turn rewards, parallel tools, MCP).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from rlf_envs.extras import MissingDependency, pip_install


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """An adapter: its module, the trainer package it drives (import name), and how to install a tested
    version of that package beside rlf-envs."""

    module: str
    package: str
    install: str


ADAPTERS: dict[str, AdapterInfo] = {
    "trl": AdapterInfo("rlf_envs.adapters.trl", "trl", pip_install("trl")),
    "verifiers": AdapterInfo(
        "rlf_envs.adapters.verifiers", "verifiers.v1",
        "pip install --no-deps verifiers==0.4.0 plus its requirements other than mcp/openai (its pins "
        "mcp==2.0.0, openai<3 clash with rlf-envs; see docs/integrations/verifiers.md)"),
    "skyrl": AdapterInfo("rlf_envs.adapters.skyrl", "skyrl_gym.envs.base_text_env", pip_install("skyrl")),
    "verl": AdapterInfo("rlf_envs.adapters.verl", "verl.experimental.agent_loop.agent_loop",
                        pip_install("verl") + " (or, CPU only: see docs/integrations/verl.md)"),
    "nemo_gym": AdapterInfo("rlf_envs.adapters.nemo_gym", "resources_servers.gymnasium",
                            "pip install --no-deps nemo-gym==0.4.0 plus its requirements other than mcp (Python >= "
                            "3.12; its mcp<2 pin clashes with rlf-envs; see docs/integrations/nemo-gym.md)"),
    "openenv": AdapterInfo("rlf_envs.adapters.openenv", "openenv.core.env_server", pip_install("openenv")),
}


def require_trainer(name: str) -> ModuleType:
    """Import the trainer package of adapter `name`, or raise `rlf_envs.extras.MissingDependency` (an
    ImportError) saying how to install it."""
    info = ADAPTERS[name]
    try:
        return importlib.import_module(info.package)
    except ImportError as e:
        raise MissingDependency(f"{info.module} needs `{info.package}` ({e}); install it with: "
                                f"{info.install}") from e


__all__ = ["ADAPTERS", "AdapterInfo", "require_trainer"]
