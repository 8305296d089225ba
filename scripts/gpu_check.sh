#!/usr/bin/env bash
# The GPU checks of the fast engine in one go, in under 5 minutes, on a machine with a CUDA GPU and no network:
# the GPU tests (CUDA graphs equal eager decode, parity with transformers in float32 and bfloat16), then the
# model benchmark (ours against transformers, batch 1/8/32, with the machine's limit) and the server
# benchmark (1/16/64 concurrent clients), each writing its output to OUT_DIR.
#
#   scripts/gpu_check.sh OUT_DIR
#
# Checkpoints are random gpt2-small-shaped ones the scripts make locally. The server benchmark needs the
# GPT-2 tokenizer files: $TOKENIZER if set, else ../shared/gpt2-tokenizer beside the repo, else a copy inside
# the repo at .gpu/tokenizer or shared/gpt2-tokenizer (a device machine receives only the repo). Every step
# runs under `timeout` and a failing step does not stop the later ones; the exit status is non-zero if any
# step failed (its status is in OUT_DIR/steps.txt).
set -uo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1" || exit 2
OUT="$(cd "$1" && pwd)"
cd "$ROOT" || exit 2
PYTHON="${PYTHON:-python}"

if [[ -z "${TOKENIZER:-}" ]]; then
    for candidate in "$ROOT/../shared/gpt2-tokenizer" "$ROOT/.gpu/tokenizer" "$ROOT/shared/gpt2-tokenizer"; do
        if [[ -f "$candidate/vocab.json" ]]; then
            TOKENIZER="$candidate"
            break
        fi
    done
fi
TOKENIZER="${TOKENIZER:-$ROOT/../shared/gpt2-tokenizer}"

# bench_server.py imports the scripts as the installed package gpt2_scripts; without an install, a link does.
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
ln -s "$ROOT/scripts" "$SHIM/gpt2_scripts"
export PYTHONPATH="$ROOT:$SHIM${PYTHONPATH:+:$PYTHONPATH}"

failed=0
: >"$OUT/steps.txt"

# step NAME SECONDS LOG COMMAND...: run COMMAND under a time limit, its output shown and kept in LOG.
step() {
    local name="$1" limit="$2" log="$3"
    shift 3
    echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/steps.txt"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
    local rc=${PIPESTATUS[0]}
    local note=""
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        note=" (timed out)"
    fi
    echo "=== $name: exit $rc$note after $((SECONDS - start))s" | tee -a "$OUT/steps.txt"
    if [[ $rc -ne 0 ]]; then
        failed=1
    fi
}

# Time limits, in seconds, add up to 290 (under 5 minutes).
step nvidia-smi 10 "$OUT/nvidia-smi.txt" nvidia-smi
step torch 30 "$OUT/torch.txt" "$PYTHON" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'
step tests 60 "$OUT/tests.txt" "$PYTHON" -m pytest tests/test_cuda_graph.py -q -rs
step bench 110 "$OUT/bench.txt" "$PYTHON" scripts/bench.py --device cuda --dtype bfloat16 --batches 1 8 32 \
    --json "$OUT/bench.json"
step server 80 "$OUT/server.txt" "$PYTHON" scripts/bench_server.py --device cuda --dtype bfloat16 \
    --levels 1 16 64 --max-batch-size 64 --tokenizer "$TOKENIZER" --json "$OUT/server.json"

if [[ $failed -ne 0 ]]; then
    echo "gpu_check: some steps failed, see $OUT/steps.txt" >&2
    exit 1
fi
echo "gpu_check: all steps passed; results in $OUT"
