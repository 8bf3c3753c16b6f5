#!/bin/bash
# Harbor verifier: writes {"reward": 1.0|0.0} to /logs/verifier/reward.json
mkdir -p /logs/verifier
python3 /tests/check.py > /logs/verifier/reward.json
