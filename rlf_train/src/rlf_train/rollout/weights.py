"""The weight store: versioned weights from the learner to the rollout side (`rollout.mode: async`).

The learner publishes (version = number of updates done); the rollout side picks up the newest between engine calls,
or exactly one version under the fixed schedule (`get`). `WeightStore` holds CPU copies in the trainer's process
(the rollout model may live on another device: the copy is loaded with `load_state_dict`); `SharedWeights` holds
them in shared memory for a worker process of its own, since a process boundary only has to carry (version, state
dict).
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class WeightStore:
    """Versioned weights from the learner to the rollout side (thread-safe)."""

    def __init__(self, keep: int = 1) -> None:
        """`keep`: how many of the newest versions stay retrievable by `get` (the fixed schedule needs
        max_staleness + 1)."""
        self._cond = threading.Condition()
        self._version = -1
        self._state: dict[str, torch.Tensor] | None = None
        self._keep = keep
        self._history: dict[int, dict[str, torch.Tensor]] = {}

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """Publish `model`'s weights as `version` (a CPU copy: the learner may go on updating in place)."""
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        with self._cond:
            if version <= self._version:
                raise ValueError(f"weights version {version} published after version {self._version}: "
                                 "versions must grow")
            self._version, self._state = version, state
            self._history[version] = state
            for old in [v for v in self._history if v <= version - self._keep]:
                del self._history[old]
            self._cond.notify_all()

    @property
    def version(self) -> int:
        with self._cond:
            return self._version

    def newer_than(self, version: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest (version, state dict) if newer than `version`, else None."""
        with self._cond:
            if self._version > version and self._state is not None:
                return self._version, self._state
            return None

    def get(self, version: int) -> dict[str, torch.Tensor] | None:
        """Exactly `version`'s state dict, if it is one of the `keep` newest published; else None."""
        with self._cond:
            return self._history.get(version)


class SharedWeights:
    """A `WeightStore` across processes: the state dicts live in shared memory (`slots` of them: version v in
    slot v % slots, so the `slots` newest versions stay retrievable by `get`), the newest version in a shared
    counter whose lock also guards the tensors. Hand it to the worker process as a `Process` argument."""

    def __init__(self, model: torch.nn.Module, ctx: Any, slots: int = 1) -> None:
        self.slots = [{k: v.detach().to("cpu", copy=True).share_memory_() for k, v in model.state_dict().items()}
                      for _ in range(slots)]
        self._slot_version = ctx.Array("q", [-1] * slots, lock=False)
        self._version = ctx.Value("q", -1)

    def publish(self, version: int, model: torch.nn.Module) -> None:
        with self._version.get_lock():
            if version <= self._version.value:
                raise ValueError(f"weights version {version} published after version {self._version.value}: "
                                 "versions must grow")
            i = version % len(self.slots)
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    self.slots[i][k].copy_(v.detach())
            self._slot_version[i] = version
            self._version.value = version

    @property
    def version(self) -> int:
        return int(self._version.value)

    def newer_than(self, version: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        with self._version.get_lock():
            v = int(self._version.value)
            if v > version:
                return v, {k: t.clone() for k, t in self.slots[v % len(self.slots)].items()}
        return None

    def get(self, version: int) -> dict[str, torch.Tensor] | None:
        with self._version.get_lock():
            i = version % len(self.slots)
            if version >= 0 and self._slot_version[i] == version:
                return {k: t.clone() for k, t in self.slots[i].items()}
        return None
