"""Runnable servers that sit next to the rlf packages (e.g. `python -m servers.retrieval`)."""
