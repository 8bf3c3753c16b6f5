#!/bin/bash
# Harbor verifier (Terminal-Bench 2 layout). Upstream tasks install uv and pytest here from the network; the
# environment for rlf's offline tests already has pytest, so this runs it directly.

if [ "$PWD" = "/" ]; then
    echo "Error: No working directory set. Please set a WORKDIR in your Dockerfile before running this script."
    exit 1
fi

mkdir -p /logs/verifier
python3 -m pytest /tests/test_outputs.py -rA -p no:cacheprovider

if [ $? -eq 0 ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
