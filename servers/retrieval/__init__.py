"""Search-R1-compatible retrieval server: a thin aiohttp layer over `rlf_envs.retrieval`.

python -m servers.retrieval build --corpus CORPUS.jsonl --out INDEX_DIR [--kind dense|bm25]
python -m servers.retrieval serve --index INDEX_DIR [--host 127.0.0.1] [--port 8000]
"""

from servers.retrieval.app import Limits, RetrieveRequest, make_app, serve

__all__ = ["Limits", "RetrieveRequest", "make_app", "serve"]
