"""Checks /app/report.json against the revenue computed from the task's data."""

import json
from pathlib import Path

REPORT = Path("/app/report.json")
EXPECTED = {"north": 42.47, "south": 159.9, "East": 1.0, "east": 3.0}


def test_report_exists():
    assert REPORT.exists(), "/app/report.json was not written"


def test_report_is_a_json_object():
    assert isinstance(json.loads(REPORT.read_text()), dict)


def test_revenue_per_region():
    got = json.loads(REPORT.read_text())
    assert set(got) == set(EXPECTED)
    for region, value in EXPECTED.items():
        assert abs(float(got[region]) - value) < 0.005, (region, got[region], value)


def test_input_untouched():
    assert Path("/app/sales.csv").read_text().count("\n") == 9
