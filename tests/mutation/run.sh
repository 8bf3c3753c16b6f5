#!/usr/bin/env bash
# Mutation testing of the local trainer with mutmut (not run in CI; see README.md beside this file).
# usage: tests/mutation/run.sh FILE [SCRATCH [MUTANT-GLOB...]]    FILE: grpo.py | trainer.py | rollout/local.py | sft.py
#   | policy/checkpoint.py | rollout/env_source.py | rollout/vllm.py (PYTHON: the `vllm` tox env's interpreter)
# Needs a venv with the train extras + mutmut (PYTHON, default: python on PATH). Works in a scratch copy.
set -euo pipefail
FILE=${1:?which file of rlf_train/src/rlf_train to mutate}
SCRATCH=${2:-/tmp/rlf-mutation-$(basename "${FILE%.py}")}
PYTHON=${PYTHON:-python}
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
rm -rf "$SCRATCH" && mkdir -p "$SCRATCH"
git -C "$REPO" ls-files -z | (cd "$REPO" && xargs -0 cp --parents -t "$SCRATCH")
# mutmut imports the mutated code from ./src (its module keys are paths under it): the package moves there,
# and the rlf_train/ project dir goes (it would shadow the package as a namespace package from the cwd)
mkdir -p "$SCRATCH/src" && mv "$SCRATCH/rlf_train/src/rlf_train" "$SCRATCH/src/" && rm -rf "$SCRATCH/rlf_train"
# the fast tests that pin the file's specification: tests-<file>.txt beside this script when there is one
# (sft.py, checkpoint.py, rollout.py, trainer.py), else tests.txt (the spec tests of grpo.py)
# (LIST=path overrides: e.g. tests-trainer-async.txt for the async path of trainer.py)
# (the lists keep the names of the files before rlf_train's wings: rollout.py, checkpoint.py, async_rollout.py, ...)
case "$FILE" in
    rollout/local.py | rollout/batch.py) NAME=rollout ;;
    rollout/env_source.py | rollout/async_worker.py | rollout/weights.py) NAME=async_rollout ;;
    rollout/vllm.py) NAME=vllm_engine ;;
    policy/checkpoint.py) NAME=checkpoint ;;
    *) NAME=${FILE%.py} ;;
esac
LIST=${LIST:-$REPO/tests/mutation/tests-$NAME.txt}
[ -f "$LIST" ] || LIST="$REPO/tests/mutation/tests.txt"
# mutmut 3 does not mutate decorated functions: the scratch copy drops `@torch.no_grad()` (rollout.generate)
# so that they are mutated too. Values are unchanged (the tests check values; grad mode is not under test).
sed -i '/^@torch\.no_grad()$/d' "$SCRATCH/src/rlf_train/$FILE"
TESTS=$(tr '\n' ' ' < "$LIST")
cat >> "$SCRATCH/pyproject.toml" <<TOML

[tool.mutmut]
source_paths = ["src/"]
only_mutate = ["src/rlf_train/$FILE"]
also_copy = ["rlf_envs/", "tests/"]
pytest_add_cli_args = ["-q", "-p", "no:cacheprovider", "-x"]
pytest_add_cli_args_test_selection = [$(printf '"%s", ' $TESTS)]
timeout_multiplier = 3.0
timeout_constant = 30.0
TOML
cd "$SCRATCH"
export PYTHONPATH="$SCRATCH/rlf_envs/src${PYTHONPATH:+:$PYTHONPATH}"
# one intra-op thread per mutant process: with MAX_CHILDREN=2 on 2 cores, torch's default (one thread per
# core) oversubscribes and a tiny forward goes from ~1 ms to ~100 ms
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
nice -n 10 "$PYTHON" -m mutmut run --max-children "${MAX_CHILDREN:-1}" "${@:3}" || true
"$PYTHON" -m mutmut results --all true > "$SCRATCH/results.txt" || true
grep -c ': killed' "$SCRATCH/results.txt" || true
grep -v ': killed' "$SCRATCH/results.txt" || true
