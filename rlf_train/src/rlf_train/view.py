"""Compatibility re-export: the viewer lives in `rlf_envs.view` (no torch needed to look at a run).

`python -m rlf_train.view` and `from rlf_train.view import ...` keep working; new code should use
`python -m rlf_envs.view` / `rlf_envs.view`.
"""

from __future__ import annotations

from rlf_envs.view import ViewError, episode_view, load_run, main, make_server, render_html, write_html

__all__ = ["ViewError", "episode_view", "load_run", "main", "make_server", "render_html", "write_html"]

if __name__ == "__main__":
    raise SystemExit(main())
