#!/bin/bash
set -euo pipefail
cd /app
python3 - <<'PY'
import csv
import json

totals = {}
with open("/app/sales.csv", newline="") as f:
    for row in csv.DictReader(f):
        try:
            units, price = int(row["units"]), float(row["unit_price"])
        except (TypeError, ValueError):
            continue
        totals[row["region"]] = totals.get(row["region"], 0.0) + units * price
with open("/app/report.json", "w") as f:
    json.dump({k: round(v, 2) for k, v in totals.items()}, f)
PY
