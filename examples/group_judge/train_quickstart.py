"""The quickstart trained on group-judge rewards: starts the scripted hidden-key judge on loopback, points
configs/quickstart_group_judge.yaml's group_reward at it and trains. Held-out success is the env's exact match,
as in the verifier-trained quickstart (README: seed 0 0.280 -> 0.815).

    python examples/group_judge/train_quickstart.py --seed 0            # ~6-10 min on a 2-core CPU
    python examples/group_judge/train_quickstart.py --set algorithm.steps=20 --set eval.every=0   # a shorter run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # `examples.group_judge` from a checkout

from examples.group_judge.hidden_key_judge import HiddenKeyJudge, judge_server  # noqa: E402
from rlf_train.config import load_config  # noqa: E402
from rlf_train.trainer import Trainer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "quickstart_group_judge.yaml"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    args = ap.parse_args(argv)
    key: dict[str, list[str]] = {}
    judge = HiddenKeyJudge(key)
    with judge_server(judge) as url:
        cfg = load_config(args.config, [f"seed={args.seed}", f"group_reward.base_url={url}", *args.set])
        trainer = Trainer(cfg)
        # the hidden criterion: the train split's answers, given to the judge out of band (not in any request)
        key.update({t.question.strip(): t.gold_answers for t in trainer.train_tasks})
        summary = trainer.run()
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("stage") == "rl"]
    total = {k: sum(r.get(f"group_judge/{k}", 0.0) for r in rl)
             for k in ("calls", "tokens_in", "tokens_out", "seconds", "fallbacks", "violations", "no_call_groups",
                       "deduplicated", "audited", "audit_warnings")}
    result = {
        "run_dir": summary["run_dir"], "seconds": summary["seconds"],
        "evals": [{"step": e["step"], "success_greedy": e.get("success_greedy"),
                   "success_sampled": e.get("success_sampled")} for e in summary["evals"]],
        "judge": {**total, "seconds_per_call": total["seconds"] / max(total["calls"], 1.0),
                  "server_requests": judge.requests, "response_formats": judge.formats,
                  "unknown_tasks": judge.unknown},
    }
    (Path(summary["run_dir"]) / "group_judge_demo.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
