#!/usr/bin/env bash
# The GPU checks of the fast engine in one go, in under 5 minutes, on a machine with a CUDA GPU and no network:
# the GPU tests (CUDA graphs equal eager decode, parity with transformers in float32 and bfloat16), then the
# model benchmark (ours against transformers, batch 1/8/32, with the machine's limit) and the server
# benchmark (1/16/64 concurrent clients), each writing its output to OUT_DIR.
#
#   scripts/gpu_prepare.sh         # first, here: stages .gpu/ (tokenizer copy, wheels of the server's packages)
#   scripts/gpu_check.sh OUT_DIR   # there, with .gpu carried; give the run at least 360 s
#
# Checkpoints are random gpt2-small-shaped ones the scripts make locally. The server benchmark needs the
# GPT-2 tokenizer files: $TOKENIZER if set, else ../shared/gpt2-tokenizer beside the repo, else the copy at
# .gpu/tokenizer (a device machine receives only the repo). Wheels in .gpu/wheels (the server's packages
# that the GPU image lacks) are installed into a temporary folder first. Every step runs under `timeout` and
# a failing step does not stop the later ones; the exit status is non-zero if any step failed (its status is
# in OUT_DIR/steps.txt). OUT_DIR gets 8 files at most.
set -uo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 OUT_DIR" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1" || exit 2
OUT="$(cd "$1" && pwd)"
cd "$ROOT" || exit 2
PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"  # the GPU image's torch is python3's

# tokenizer files as the loader takes them: tokenizer.json, or vocab.json with merges.txt
has_tokenizer() { [[ -f "$1/tokenizer.json" || (-f "$1/vocab.json" && -f "$1/merges.txt") ]]; }
if [[ -z "${TOKENIZER:-}" ]]; then
    for candidate in "$ROOT/../shared/gpt2-tokenizer" "$ROOT/.gpu/tokenizer"; do
        if has_tokenizer "$candidate"; then
            TOKENIZER="$candidate"
            break
        fi
    done
fi
TOKENIZER="${TOKENIZER:-$ROOT/.gpu/tokenizer}"

# bench_server.py imports the scripts as the installed package gpt2_scripts; without an install, a link does.
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
ln -s "$ROOT/scripts" "$SHIM/gpt2_scripts"
export PYTHONPATH="$ROOT:$SHIM${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G "$ROOT/.gpu/wheels/*.whl" >/dev/null; then
    "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
        --target "$SHIM/site" "$ROOT"/.gpu/wheels/*.whl || echo "gpu_check: installing .gpu/wheels failed" >&2
    export PYTHONPATH="$SHIM/site:$PYTHONPATH"
fi
export GPT2_REQUIRE_CUDA=1  # the CUDA tests fail, not skip, when no GPU is visible

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

# what the later steps need: the GPU, torch with CUDA, the server's packages, the tokenizer
preflight() {
    nvidia-smi || return 1
    "$PYTHON" - <<'PY' || return 1
import importlib, sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)
print("device:", torch.cuda.get_device_name())
missing = []
for name in ("fastapi", "uvicorn", "pydantic", "transformers", "httpx", "safetensors", "tokenizers", "prometheus_client"):
    try:
        importlib.import_module(name)
    except ImportError as e:
        missing.append(f"{name} ({e})")
if missing:
    sys.exit("missing packages (run scripts/gpu_prepare.sh here and carry .gpu): " + ", ".join(missing))
print("packages: ok")
PY
    if ! has_tokenizer "$TOKENIZER"; then
        echo "no GPT-2 tokenizer files in $TOKENIZER (run scripts/gpu_prepare.sh and carry .gpu)" >&2
        return 1
    fi
    echo "tokenizer: $TOKENIZER"
}

export PYTHON TOKENIZER
export -f has_tokenizer preflight

# Time limits, in seconds, add up to 290 (under 5 minutes).
step preflight 40 "$OUT/preflight.txt" bash -c preflight
step tests 60 "$OUT/tests.txt" "$PYTHON" -m pytest tests/test_cuda_graph.py -q -rs -p no:cacheprovider
step bench 110 "$OUT/bench.txt" "$PYTHON" scripts/bench.py --device cuda --dtype bfloat16 --batches 1 8 32 \
    --reps 2 --json "$OUT/bench.json"
step server 80 "$OUT/server.txt" "$PYTHON" scripts/bench_server.py --device cuda --dtype bfloat16 \
    --levels 1 16 64 --max-batch-size 64 --tokenizer "$TOKENIZER" --json "$OUT/server.json" \
    --server-log "$OUT/server-log.txt"

if [[ $failed -ne 0 ]]; then
    echo "gpu_check: some steps failed, see $OUT/steps.txt" >&2
    exit 1
fi
echo "gpu_check: all steps passed; results in $OUT"
