#!/bin/bash
cat > /app/greet.py <<'PY'
import os

print(os.environ.get("GREETING", "hi") + ", world")
PY
