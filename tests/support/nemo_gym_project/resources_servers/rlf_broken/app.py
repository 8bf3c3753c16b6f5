"""A NeMo-Gym resources server that fails as it starts (rlf's tests: a server that does not start is an error before
training, with its log)."""

raise RuntimeError("rlf_broken fails at start on purpose")
