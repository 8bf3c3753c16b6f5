"""The policy endpoint: an OpenAI-compatible server in front of the rollout engine, one token-exact session
per episode, so agent code written against the OpenAI API is a rollout source (`rlf_train.rollout.agent_source`).

- `sessions`: matching each request to the conversation so far; segments of exact ids and loss masks.
- `engine`: requests of many sessions batched into the engine's calls.
- `server`: the aiohttp app (`/v1/chat/completions`, `/v1/models`, streaming, errors).
"""
