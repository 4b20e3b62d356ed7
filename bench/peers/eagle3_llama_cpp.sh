#!/usr/bin/env bash
# A head verispec trained, drafting in llama.cpp: export it in the speculators layout (the one llama.cpp's
# converter reads for EAGLE-3, with the target's config and tokenizer from --target-model-dir), convert it
# to GGUF, and run llama-speculative-simple --spec-type draft-eagle3 against the target's GGUF.
#
#   bash bench/peers/eagle3_llama_cpp.sh HEAD_DIR [TARGET] [N_PREDICT]     # TARGET: a zoo name, pulled
#
# Needs bench/peers/build_llama_cpp.sh run first, and sentencepiece (the converter imports it before it
# falls back to the target's tokenizer.json). The target's llama.cpp graph must expose its layer inputs
# (llama, qwen3, ... do; qwen2 does not in llama-cpp-python 0.3.36: see bench/reports/eagle3_llama_cpp.md).
# Writes under $OUT (default ~/.cache/verispec/peers/eagle3/<head name>): speculators/, eagle3-f16.gguf,
# convert.log, run.log.
set -euo pipefail
HEAD=${1:?usage: eagle3_llama_cpp.sh HEAD_DIR [TARGET] [N_PREDICT]}
TARGET=${2:-qwen2.5-coder-1.5b}
N_PREDICT=${3:-32}
HOME_DIR=${VERISPEC_HOME:-$HOME/.cache/verispec}
PEER=$HOME_DIR/peers/llama.cpp
BIN=$PEER/build/bin
OUT=${OUT:-$HOME_DIR/peers/eagle3/$(basename "$HEAD")}
PROMPT=${PROMPT:-"def fibonacci(n):"}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH=$REPO/src${PYTHONPATH:+:$PYTHONPATH}
[ -x "$BIN/llama-speculative-simple" ] || { echo "no llama.cpp peer in $PEER: run bench/peers/build_llama_cpp.sh" >&2; exit 1; }
[ -d "$HOME_DIR/$TARGET/hf" ] || { echo "no $TARGET in $HOME_DIR: run verispec pull $TARGET" >&2; exit 1; }
python -c "import sentencepiece" 2>/dev/null || { echo "llama.cpp's converter imports sentencepiece: pip install sentencepiece" >&2; exit 1; }
mkdir -p "$OUT"

echo "[1/3] export $HEAD in the speculators layout (tap ids as llama.cpp counts them: inputs of layers)"
python -m verispec.cli export "$HEAD" --to speculators --out "$OUT/speculators"

echo "[2/3] convert to GGUF with $TARGET's config and tokenizer"
python "$PEER/src/vendor/llama.cpp/convert_hf_to_gguf.py" "$OUT/speculators" --target-model-dir "$HOME_DIR/$TARGET/hf" \
  --outfile "$OUT/eagle3-f16.gguf" --outtype f16 > "$OUT/convert.log" 2>&1 || { tail -20 "$OUT/convert.log" >&2; exit 1; }
grep "EAGLE-3" "$OUT/convert.log"

echo "[3/3] llama-speculative-simple --spec-type draft-eagle3 -n $N_PREDICT (greedy)"
LD_LIBRARY_PATH=$BIN "$BIN/llama-speculative-simple" -m "$HOME_DIR/$TARGET/$TARGET.gguf" -md "$OUT/eagle3-f16.gguf" \
  --spec-type draft-eagle3 --spec-draft-n-max 3 -n "$N_PREDICT" --temp 0 -c 1024 -t "$(nproc)" -p "$PROMPT" 2>&1 \
  | tee "$OUT/run.log"
