"""What a foreign environment costs per episode beside the same task written for rlf, measured in one run.

The quickstart's search task three ways, each a training batch (prompts x samples episodes) collected by the trainer's
own rollout source with the same policy, interleaved round by round so machine load hits all alike:

- `rlf env`: rlf/Search-v0, env-driven (the baseline);
- `rlf agent`: examples/search_agent/agent.py through the policy endpoint (`rollout.agent`);
- `verifiers`: tests/support/foreign_vf_search.py through the endpoint (`rollout.environment`), its harness, MCP tool
  server and rubric (needs verifiers: tox -e adapters' venv);
- `openenv` (with --openenv): tests/support/foreign_openenv_lookup.py, a two-tool MCPEnvironment over OpenEnv's
  WebSocket server (needs openenv-core: tox -e adapters-rl's venv; a different, equally short task).
- `nemo_gym` (with --nemo-gym): tests/support/nemo_gym_project's rlf_lookup, a NeMo-Gym resources server with a
  search tool, run by NeMo-Gym's simple_agent and vllm_model (needs a NeMo-Gym interpreter in $RLF_NEMO_GYM_PYTHON:
  tests/support/nemo_gym_venv.py; a different, equally short task).

    PYTHONPATH=$PWD/tests/support python benchmarks/foreign_envs.py --model runs/qs-sft/checkpoints/sft

Prints ms per episode and the ratio to `rlf env` (house rule 6); `--json PATH` also writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SEARCH_KW = ("{format: search_r1, world: quickstart, topk: 1, format_kwargs: {instruction: 'Question: {question}\\n'}}")
FOREIGN_KW = "{format: search_r1, format_kwargs: {instruction: 'Question: {question}\\n'}}"


def nemo_gym_rows(path: Path, n: int) -> Path:
    """`n` rows of the rlf_lookup task (its own data has 8): one per person."""
    src = REPO / "tests/support/nemo_gym_project/resources_servers/rlf_lookup/data/train.jsonl"
    first = json.loads(src.read_text().splitlines()[0])
    with path.open("w") as f:
        for i in range(n):
            row = json.loads(json.dumps(first).replace("Person00", f"Person{i:02d}"))
            row["id"] = i
            f.write(json.dumps(row) + "\n")
    return path


def configs(model: str, openenv: bool, nemo_gym: Path | None = None) -> dict[str, list[str]]:
    base = [f"model.name_or_path={model}"] if model != "tiny" else [
        "model.tiny={hidden_size: 96, num_layers: 2, num_heads: 4, num_kv_heads: 2, intermediate_size: 256, "
        "tokenizer_file: quickstart_tokenizer.json}"]
    base += ["rollout.max_turns=3", "rollout.max_new_tokens_per_turn=12", "rollout.max_total_tokens=512",
             "sft.enabled=false", "threads=1", "logging.progress=false", "logging.tensorboard=false"]
    out = {
        "rlf env": [*base, f"env.kwargs={SEARCH_KW}"],
        "rlf agent": [*base, f"env.kwargs={SEARCH_KW}", f"rollout.agent={REPO}/examples/search_agent/agent.py:agent"],
    }
    try:
        import verifiers.v1  # noqa: F401

        out["verifiers"] = [*base, "rollout.environment=verifiers:foreign_vf_search", f"env.kwargs={FOREIGN_KW}"]
    except ImportError:
        print("(verifiers not installed: its row is skipped)", file=sys.stderr)
    if openenv:
        out["openenv"] = [*base, "rollout.environment=openenv:foreign_openenv_lookup:app",
                          "rollout.max_new_tokens_per_turn=48",
                          "rollout.max_total_tokens=2048"]  # (its tools in the prompt)
    if nemo_gym is not None:
        lookup = REPO / "tests/support/nemo_gym_project/resources_servers/rlf_lookup/configs/rlf_lookup.yaml"
        out["nemo_gym"] = [*base, f"rollout.environment=nemo_gym:{lookup}", "rollout.max_new_tokens_per_turn=48",
                           "rollout.max_total_tokens=2048",
                           f"env.kwargs.options={{datasets: {{train: {nemo_gym}, test: {nemo_gym}}}}}"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="a checkpoint dir (e.g. the quickstart's SFT) or 'tiny'")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--openenv", action="store_true")
    ap.add_argument("--nemo-gym", action="store_true", help="add the NeMo-Gym row ($RLF_NEMO_GYM_PYTHON)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args()

    import torch

    from rlf_train.config import load_config
    from rlf_train.trainer import Trainer

    tmp = Path(tempfile.mkdtemp(prefix="rlf-foreign-bench-"))
    trainers: dict[str, Any] = {}
    rows_file = nemo_gym_rows(tmp / "nemo_gym_rows.jsonl", (args.rounds + 1) * args.prompts) if args.nemo_gym else None
    for name, sets in configs(args.model, args.openenv, rows_file).items():
        cfg = load_config(None, [*sets, f"rollout.prompts_per_step={args.prompts}",
                                 f"rollout.samples_per_prompt={args.samples}", f"logging.run_dir={tmp / name}"])
        trainers[name] = Trainer(cfg)
    times: dict[str, list[float]] = {n: [] for n in trainers}
    turns: dict[str, list[float]] = {n: [] for n in trainers}
    n_eps = args.prompts * args.samples
    try:
        for r in range(args.rounds + 1):  # round 0 warms up (servers, the endpoint, caches)
            for name, tr in trainers.items():
                idx = [p for p in range(r * args.prompts, (r + 1) * args.prompts) for _ in range(args.samples)]
                t0 = time.perf_counter()
                got = tr.collect("train", idx, tr._sampling(), seed_base=r, gen=torch.Generator().manual_seed(r))
                dt = time.perf_counter() - t0
                if r:
                    times[name].append(1000 * dt / n_eps)
                    turns[name].append(sum(len(t.turns) for t in got.trajectories) / max(len(got.trajectories), 1))
    finally:
        for tr in trainers.values():
            tr.source.close()
    base = statistics.median(times["rlf env"])
    rows = []
    print(f"{'source':<11} {'ms/episode':>11} {'x rlf env':>10} {'turns/row':>10}")
    for name in trainers:
        ms = statistics.median(times[name])
        rows.append({"source": name, "ms_per_episode": ms, "ratio_to_rlf_env": ms / base,
                     "turns_per_row": statistics.mean(turns[name]), "rounds": times[name]})
        print(f"{name:<11} {ms:>11.1f} {ms / base:>10.2f} {statistics.mean(turns[name]):>10.2f}")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"model": args.model, "episodes_per_batch": n_eps, "rows": rows}, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
