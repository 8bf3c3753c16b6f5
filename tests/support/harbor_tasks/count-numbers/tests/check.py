import json
import os

try:
    got = int(open(os.environ.get("EXPECTED_FILE", "/data/answer.txt")).read().strip())
except (OSError, ValueError):
    got = None
print(json.dumps({"reward": 1.0 if got == 15 + 100 - 7 else 0.0, "answer_found": 0.0 if got is None else 1.0}))
