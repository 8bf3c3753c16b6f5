"""Where the tests find the repository and their support files (tests/support/: helper modules, assets, servers,
Harbor task directories), wherever the test module itself sits in tests/."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
TESTS = SUPPORT.parent
REPO = TESTS.parent
