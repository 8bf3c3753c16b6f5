"""my-rlf-env: an example rlf env package (see pyproject.toml's `rlf_envs.envs` entry point).

Keep this module light: `import rlf_envs` imports it to read ENVS; the env class itself is imported only
when an env is made.
"""

ENVS = {"myenv/Arithmetic-v0": "my_rlf_env.env:ArithmeticEnv"}
