"""rlf's offline text-to-SQL data: three small invented SQLite databases and Spider-style questions.

Files (regenerate with `python -m rlf_envs.data.sql.generate`): `databases/<db_id>.sql` (SQL dumps),
`train.json` and `test.json` (Spider format: `[{"db_id", "question", "query"}]`). `database_dir()`
builds the dumps into Spider's layout, `<dir>/<db_id>/<db_id>.sqlite`, once in rlf's cache dir.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import tempfile
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
DUMPS_DIR = DATA_DIR / "databases"


def split_path(split: str) -> Path:
    """The Spider-style JSON file of `split` ("train" or "test")."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return DATA_DIR / f"{split}.json"


def database_dir() -> Path:
    """The shipped databases as `<dir>/<db_id>/<db_id>.sqlite` in rlf's cache dir (`$RLF_CACHE_DIR`, else
    ~/.cache/rlf), built from the SQL dumps once; the directory name carries the dumps' digest."""
    dumps = sorted(DUMPS_DIR.glob("*.sql"))
    if not dumps:
        raise FileNotFoundError(f"no SQL dumps in {DUMPS_DIR}: run `python -m rlf_envs.data.sql.generate`")
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in dumps)).hexdigest()[:12]
    out = Path(os.environ.get("RLF_CACHE_DIR") or Path.home() / ".cache" / "rlf") / f"sql-{digest}"
    for dump in dumps:
        db = out / dump.stem / f"{dump.stem}.sqlite"
        if db.is_file():
            continue
        db.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=db.parent, suffix=".tmp")
        os.close(fd)
        try:
            conn = sqlite3.connect(tmp)
            try:
                conn.executescript(dump.read_text(encoding="utf-8"))
            finally:
                conn.close()
            os.replace(tmp, db)  # atomic: a concurrent builder writes the same bytes
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


__all__ = ["DATA_DIR", "DUMPS_DIR", "database_dir", "split_path"]
