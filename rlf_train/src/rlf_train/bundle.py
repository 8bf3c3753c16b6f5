"""Replay bundles: one update step of a run, written so that it can be recomputed on a laptop (`rlf_train.replay`).

`logging.replay_every: N` writes `run_dir/replay/step_K/` every N RL steps:

- `manifest.json` (`BundleManifest`): the step, the policy version, the run's config, the rows' group layout
  (task indices; for agent rows the episode of each row and the episode rewards), the step's metrics, and
  hashes of the weights before and after the update, of the tokenizer and of rlf's code.
- `rows.jsonl`: the rows the update trained on, as trajectory records (`rlf_envs.records`): token ids, loss
  masks, action spans, per-turn and final rewards with the verifier's components (`score_info`), the answer and
  the tool results the verifier saw, policy versions and behaviour log-probs.
- `tensors.pt` (`BundleTrace`): what the update computed, stage by stage: returns and advantages, the loss mask
  it used, the learner's, the reference's and the behaviour log-probs, each micro-batch's loss terms and each
  optimizer step's gradient norm.
- `state.pt` with `logging.replay_weights: true`: the policy, optimizer and scheduler state from before the
  update, so a replay recomputes the log-probs, every loss term and the updated weights bit for bit.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from rlf_envs.errors import RlfError
from rlf_envs.records import TrajectoryRecord, atomic_write_text
from rlf_envs.types import Trajectory

SCHEMA = 1
REPLAY_DIR = "replay"


class BundleError(RlfError, ValueError):
    """A replay bundle that is missing, incomplete or of another schema."""


@dataclass
class MicroStep:
    """One micro-batch's forward/backward of the update: where it was and what its loss came to."""

    epoch: int
    rows: tuple[int, int]  # [start, end) rows of the batch
    loss: float
    pg_loss: float
    kl: float
    clip_frac: float


@dataclass
class BundleTrace:
    """What `Trainer.update` computed on one batch, filled in while the step is recorded."""

    trajectories: list[Trajectory] = field(default_factory=list)
    task_indices: list[int] = field(default_factory=list)
    episode_of_row: list[int] | None = None
    episode_rewards: list[float] | None = None
    behaviour: bool = False
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # returns, ep_returns, adv, mask, old_lp, ...
    micro: list[MicroStep] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)


class BundleManifest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA
    step: int
    policy_version: int
    engine: str
    config: dict[str, Any]
    task_indices: list[int]
    episode_of_row: list[int] | None = None
    episode_rewards: list[float] | None = None
    behaviour: bool = False
    metrics: dict[str, Any]
    hashes: dict[str, str]
    threads: int
    torch_version: str
    has_state: bool = False


@dataclass
class Bundle:
    """A bundle read back: the manifest, the rows as trajectories, the recorded tensors, the state if kept."""

    path: Path
    manifest: BundleManifest
    trajectories: list[Trajectory]
    tensors: dict[str, torch.Tensor]
    micro: list[MicroStep]
    grad_norms: list[float]
    state: dict[str, Any] | None


def state_hash(state: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes (in name order)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def tokenizer_hash(tokenizer: Any) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(text.encode()).hexdigest()


def code_hash() -> dict[str, str]:
    """sha256 of rlf_train's and rlf_envs' source files, and the git commit when the code is a checkout."""
    out: dict[str, str] = {}
    for pkg in ("rlf_train", "rlf_envs"):
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        h = hashlib.sha256()
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
        out[f"code_{pkg}"] = h.hexdigest()
        try:
            commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                    timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
        if commit:
            out["git_commit"] = commit
    return out


def bundle_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / REPLAY_DIR / f"step_{step:06d}"


def write_bundle(path: Path, *, step: int, policy_version: int, engine: str, config: dict[str, Any],
                 trace: BundleTrace, metrics: dict[str, Any], hashes: dict[str, str],
                 state: dict[str, Any] | None) -> Path:
    """Write one bundle directory (the manifest last: a directory without one is not a bundle)."""
    path.mkdir(parents=True, exist_ok=True)
    rows = [TrajectoryRecord.from_trajectory(t, source="train", step=step, index=i)
            for i, t in enumerate(trace.trajectories)]
    atomic_write_text(path / "rows.jsonl", "".join(r.to_json() + "\n" for r in rows))
    torch.save({"tensors": {k: v.detach().to("cpu") for k, v in trace.tensors.items()},
                "micro": [asdict(m) for m in trace.micro], "grad_norms": list(trace.grad_norms)},
               path / "tensors.pt")
    if state is not None:
        torch.save(state, path / "state.pt")
    manifest = BundleManifest(step=step, policy_version=policy_version, engine=engine, config=config,
                              task_indices=list(trace.task_indices), episode_of_row=trace.episode_of_row,
                              episode_rewards=trace.episode_rewards, behaviour=trace.behaviour,
                              metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float, str))},
                              hashes=hashes, threads=torch.get_num_threads(), torch_version=torch.__version__,
                              has_state=state is not None)
    atomic_write_text(path / "manifest.json", manifest.model_dump_json(indent=1))
    return path


def read_bundle(path: str | Path) -> Bundle:
    """Read a bundle directory (or a run's replay/ directory's `step_K` given as `run_dir/replay/step_K`)."""
    p = Path(path)
    if not (p / "manifest.json").is_file():
        raise BundleError(f"{p}: no manifest.json, so not a replay bundle (a run writes them under "
                          f"run_dir/{REPLAY_DIR}/step_K/ with logging.replay_every: N)")
    try:
        manifest = BundleManifest.model_validate_json((p / "manifest.json").read_text())
    except ValueError as e:
        raise BundleError(f"{p}/manifest.json: {e}") from None
    if manifest.schema_version != SCHEMA:
        raise BundleError(f"{p}: bundle schema {manifest.schema_version}, this rlf reads schema {SCHEMA}")
    for name in ("rows.jsonl", "tensors.pt"):
        if not (p / name).is_file():
            raise BundleError(f"{p}: {name} is missing (an interrupted write?)")
    rows = [TrajectoryRecord.from_json(line) for line in (p / "rows.jsonl").read_text().splitlines() if line]
    blob = torch.load(p / "tensors.pt", map_location="cpu", weights_only=True)
    state = None
    if manifest.has_state:
        if not (p / "state.pt").is_file():
            raise BundleError(f"{p}: the manifest says state.pt was kept, but it is missing")
        state = torch.load(p / "state.pt", map_location="cpu", weights_only=True)
    return Bundle(path=p, manifest=manifest, trajectories=[r.to_trajectory() for r in rows],
                  tensors=blob["tensors"], micro=[MicroStep(**{**m, "rows": tuple(m["rows"])}) for m in blob["micro"]],
                  grad_norms=list(blob["grad_norms"]), state=state)


def list_bundles(path: str | Path) -> list[Path]:
    """The bundles under a run's replay/ dir (or the run dir), in step order; a bundle dir is itself."""
    p = Path(path)
    if (p / "manifest.json").is_file():
        return [p]
    if (p / REPLAY_DIR).is_dir():
        p = p / REPLAY_DIR
    return sorted(d for d in p.glob("step_*") if (d / "manifest.json").is_file())
