#!/bin/bash
# Harbor verifier: writes 1 or 0 to /logs/verifier/reward.txt
mkdir -p /logs/verifier
out="$(cd /app && GREETING=hello python3 greet.py 2>/dev/null)"
if [ "$out" = "hello, world" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
