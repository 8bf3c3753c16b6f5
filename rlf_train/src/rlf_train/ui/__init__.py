"""`python -m rlf_train.ui`: a local web app to set up a tool pool, pick an env, a reward and a model, and start,
stop, resume and watch `python -m rlf_train` runs (docs/guides/web-ui.md).

Nothing here is a second implementation: the pool connects and calls tools through rlf_envs' MCP client,
function tools and `ToolCaller`; configs are composed with `rlf_train.config`'s own override and validation
code and checked by `python -m rlf_train --dry-run`; a run is the same `python -m rlf_train --config
RUN_DIR/config.yaml` process; trajectories are shown by `rlf_envs.view`.

- `app`: the aiohttp app (routes, the page's lifecycle) and the command line; `security`: who may use it.
- `pool`: the tool pool (MCP servers, Python tools), its live checks and tool trials.
- `spec`: what the page sends (`RunSpec`) and how it becomes a config (`compose`), the dry-run check.
- `runs`: the run processes (start, stop, resume) and what a run dir says (progress, curves, tool stats).
- `pool_env`: the env id `rlf_ui/Pool-v0` (rlf/Tools-v0 plus Python tools named by import path), so a run
  with the pool's Python tools is reproducible from the command line.

Importing this package imports nothing heavy (no aiohttp, no torch): `pool_env` is imported by training runs.
"""
