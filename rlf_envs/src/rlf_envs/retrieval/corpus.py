"""Corpus reading (wiki-18 JSONL) and the on-disk document store of an index directory.

The store is `docs.jsonl` (one normalised `{"id", "contents"}` object per line) plus `offsets.npy`
(int64 byte offsets, one more than the number of documents). It is memory-mapped, so a 21M-passage
corpus costs no Python objects until a document is actually returned.
"""

from __future__ import annotations

import array
import functools
import json
import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from rlf_envs.retrieval.types import Document, Hit, RetrievalError

DOCS_NAME = "docs.jsonl"
OFFSETS_NAME = "offsets.npy"


def parse_corpus_line(line: str, where: str) -> Document:
    """One corpus line to a Document. Accepts `{"id", "contents"}` or `{"id", "title", "text"}`."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise RetrievalError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(raw, dict):
        raise RetrievalError(f"{where}: each line must be a JSON object, got {type(raw).__name__}")
    doc_id = raw.get("id")
    if isinstance(doc_id, bool) or not isinstance(doc_id, str | int):
        raise RetrievalError(f"{where}: 'id' must be a string or an integer, got {doc_id!r}")
    contents = raw.get("contents")
    if contents is None and isinstance(raw.get("text"), str):
        title = raw.get("title", "")
        if not isinstance(title, str):
            raise RetrievalError(f"{where}: 'title' must be a string")
        contents = f'"{title}"\n{raw["text"]}'
    if not isinstance(contents, str):
        raise RetrievalError(f"{where}: needs a string 'contents' (wiki-18 format: '\"Title\"\\ntext') or 'text'")
    return Document(id=str(doc_id), contents=contents)


def iter_corpus(path: str | Path) -> Iterator[Document]:
    """Stream a JSONL corpus, skipping blank lines; errors name the file and line."""
    p = Path(path)
    if not p.is_file():
        raise RetrievalError(f"corpus file {p} does not exist")
    with p.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield parse_corpus_line(line, f"{p}:{lineno}")


def write_docstore(docs: Iterator[Document], directory: Path) -> int:
    """Write `docs.jsonl` + `offsets.npy` into `directory`; return the number of documents.

    Streams: memory is the offsets only (8 bytes per document, 168 MB for wiki-18's 21M passages)."""
    offsets = array.array("q", [0])
    pos = 0
    with (directory / DOCS_NAME).open("wb") as f:
        for doc in docs:
            data = (json.dumps(doc.to_dict(), ensure_ascii=False) + "\n").encode("utf-8")
            f.write(data)
            pos += len(data)
            offsets.append(pos)
    np.save(directory / OFFSETS_NAME, np.frombuffer(offsets, dtype=np.int64))
    return len(offsets) - 1


DOC_CACHE_SIZE = 65536


class DocStore:
    """Read-only, memory-mapped access to an index directory's documents by position."""

    def __init__(self, directory: str | Path) -> None:
        d = Path(directory)
        docs_path, offsets_path = d / DOCS_NAME, d / OFFSETS_NAME
        if not docs_path.is_file() or not offsets_path.is_file():
            raise RetrievalError(f"{d} lacks {DOCS_NAME} / {OFFSETS_NAME}: the index is incomplete, rebuild it")
        self._offsets = np.load(offsets_path, mmap_mode="r")
        self._file = docs_path.open("rb")
        size = docs_path.stat().st_size
        if size != int(self._offsets[-1]):
            self._file.close()
            raise RetrievalError(f"{docs_path} is {size} bytes but offsets say {int(self._offsets[-1])}: rebuild")
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        # parsed documents of recent hits (Documents are immutable; searches repeat across a GRPO group)
        self._get = functools.lru_cache(maxsize=DOC_CACHE_SIZE)(self._load)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, i: int) -> Document:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._get(i)

    def _load(self, i: int) -> Document:
        if self._mm is None:
            raise IndexError(i)
        start, end = int(self._offsets[i]), int(self._offsets[i + 1])
        raw = json.loads(self._mm[start:end])
        return Document(id=raw["id"], contents=raw["contents"])

    def __iter__(self) -> Iterator[Document]:
        return self.iter_from(0)

    def iter_from(self, start: int) -> Iterator[Document]:
        """Documents `start`, `start + 1`, ... to the end (bypassing the hit cache a full pass would churn)."""
        for i in range(start, len(self)):
            yield self._load(i)

    def close(self) -> None:
        self._get.cache_clear()
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        self._file.close()


def format_hits(hits: list[Hit]) -> str:
    """Render hits the way Search-R1 shows them to the policy: `Doc 1(Title: "X") text` per line."""
    lines = []
    for i, hit in enumerate(hits, 1):
        first, _, rest = hit.document.contents.partition("\n")
        lines.append(f"Doc {i}(Title: {first}) {rest}")
    return "\n".join(lines) + ("\n" if lines else "")
