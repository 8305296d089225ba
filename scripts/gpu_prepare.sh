#!/usr/bin/env bash
# Stage, here, what scripts/gpu_check.sh needs on a GPU machine that has no network and receives only the
# repository: a copy of the GPT-2 tokenizer files and wheels of the server's packages that the GPU image
# lacks (fastapi, uvicorn, pydantic and what they import), for that machine's Python (3.12, x86-64 Linux).
# Everything goes into .gpu/ (git-ignored), which the run must carry:
#
#   scripts/gpu_prepare.sh            # here, with the package registry reachable
#   (device run, carrying .gpu)       scripts/gpu_check.sh OUT_DIR
#
# The wheels are the versions installed here, the ones the test suite ran against. The tokenizer comes from
# $TOKENIZER if set, else ../shared/gpt2-tokenizer beside the repository.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.gpu"
PYTHON="${PYTHON:-python}"
TARGET_PYTHON="${TARGET_PYTHON:-3.12}"
TOKENIZER="${TOKENIZER:-$ROOT/../shared/gpt2-tokenizer}"

# The server's imports that the GPU image does not hold (its package list is in the device tool's KINDS.md),
# with the packages they need at a version the image may not have.
PACKAGES=(fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection
    typing-extensions opentelemetry-api uvicorn click h11 anyio idna)

if [[ ! -f "$TOKENIZER/tokenizer.json" && ! (-f "$TOKENIZER/vocab.json" && -f "$TOKENIZER/merges.txt") ]]; then
    echo "gpu_prepare: no GPT-2 tokenizer files (tokenizer.json, or vocab.json and merges.txt) in $TOKENIZER" >&2
    exit 1
fi
rm -rf "$DEST/tokenizer" "$DEST/wheels"
mkdir -p "$DEST/tokenizer" "$DEST/wheels"
for f in tokenizer.json vocab.json merges.txt; do
    if [[ -f "$TOKENIZER/$f" ]]; then
        cp "$TOKENIZER/$f" "$DEST/tokenizer/"
    fi
done

pins=()
for p in "${PACKAGES[@]}"; do
    v="$("$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$p")"
    pins+=("$p==$v")
done
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DEST/wheels" \
    --python-version "$TARGET_PYTHON" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "${pins[@]}"
echo "gpu_prepare: $(find "$DEST/wheels" -name "*.whl" | wc -l) wheels and the tokenizer in $DEST ($(du -sh "$DEST" | cut -f1)); carry .gpu"
