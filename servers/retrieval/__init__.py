"""Search-R1-compatible retrieval server: a thin aiohttp layer over `rlf_envs.retrieval`.

rlf-retrieval build --corpus CORPUS.jsonl --out INDEX_DIR [--kind dense|bm25]
rlf-retrieval serve --index INDEX_DIR [--host 127.0.0.1] [--port 8000]
(installed from the checkout's root: `pip install -e ./rlf_envs ./servers`)
(in the repo, without installing: `python -m servers.retrieval ...`)
"""

from .app import Limits, RetrieveRequest, make_app, serve

__all__ = ["Limits", "RetrieveRequest", "make_app", "serve"]
