"""Run in the `envs` tox env: torch/transformers are not installed and rlf_envs works without them."""

import importlib.util
import sys

for mod in ("torch", "transformers"):
    if importlib.util.find_spec(mod) is not None:
        sys.exit(f"{mod} is installed in this env; the `envs` env must prove rlf_envs works without it")

import gymnasium as gym  # noqa: E402

import rlf_envs  # noqa: E402,F401

env = gym.make("rlf/Calculator-v0")
env.reset(seed=0)
action = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
_, reward, terminated, _, _ = env.step(action)
assert not terminated
loaded = sorted(m for m in ("torch", "transformers") if m in sys.modules)
assert loaded == [], loaded
print("rlf_envs imports and runs without torch/transformers")
