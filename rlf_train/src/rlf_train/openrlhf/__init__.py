"""`backend: openrlhf`: the same YAML trains through OpenRLHF's Ray PPO/GRPO, whose vLLM engines generate
while rlf envs are stepped token in / token out.

- `flags`: the config -> OpenRLHF's dotted CLI flags (every key mapped or refused by name);
- `parser`: checks flags with OpenRLHF's own parser from the installed package (no GPU needed);
- `launcher`: writes the run dir (prompt datasets, resolved config, the exact command) and starts the run
  on a local Ray head or submits it to `openrlhf.ray_address`;
- `executor` / `agent`: the `AgentExecutor` OpenRLHF loads in its rollout actors.

Only `executor` and `agent` import OpenRLHF; the rest works without it (`--dry-run` on any machine).
"""
