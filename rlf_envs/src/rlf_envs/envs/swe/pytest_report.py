"""The pytest plugin that reports each test's outcome as JSON (the generator's and the hidden run's source of truth).

`PLUGIN_SOURCE` is written as a module next to (never inside) the repository under test and loaded with
`-p <module>`; it writes `{nodeid: {"outcome": "passed"|"failed"|"skipped"|"error", "message": str}}` to the
path in the environment variable `RLF_PYTEST_REPORT` when the session ends. `parse_report` reads it back,
strictly: anything but that shape is an empty report (every asked-for test then counts as not passed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

PLUGIN_MODULE = "rlf_pytest_report"
REPORT_ENV = "RLF_PYTEST_REPORT"

PLUGIN_SOURCE = '''
import json, os

_OUT = {}


def _message(report):
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return str(crash.message)[:2000]
    text = str(getattr(report, "longrepr", "") or "")
    return text.strip().splitlines()[-1][:2000] if text.strip() else ""


def pytest_runtest_logreport(report):
    entry = _OUT.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.failed:
        if entry["outcome"] != "failed":
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["message"] = _message(report)
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_collectreport(report):
    if report.failed:
        _OUT[report.nodeid or "<collection>"] = {"outcome": "error", "message": _message(report)}


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("RLF_PYTEST_REPORT")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(_OUT, f)
'''


@dataclass(frozen=True, slots=True)
class PytestOutcome:
    outcome: str  # passed | failed | skipped | error
    message: str = ""

    @property
    def passed(self) -> bool:
        return self.outcome == "passed"


def parse_report(text: str | bytes, limit: int = 1 << 22) -> dict[str, PytestOutcome]:
    """The plugin's JSON as outcomes by node id; malformed or oversized input gives {}."""
    if len(text) > limit:
        return {}
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        return {}
    if not isinstance(data, dict):
        return {}
    out: dict[str, PytestOutcome] = {}
    for k, v in data.items():
        if isinstance(k, str) and isinstance(v, dict) and isinstance(v.get("outcome"), str):
            out[k] = PytestOutcome(v["outcome"], str(v.get("message", ""))[:2000])
    return out


__all__ = ["PLUGIN_MODULE", "PLUGIN_SOURCE", "REPORT_ENV", "PytestOutcome", "parse_report"]
