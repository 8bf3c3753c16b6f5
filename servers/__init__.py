"""Runnable servers that sit next to the rlf packages (`python -m servers.retrieval` in the repo; installed from
./servers as `rlf_servers`, with the `rlf-retrieval` command)."""
