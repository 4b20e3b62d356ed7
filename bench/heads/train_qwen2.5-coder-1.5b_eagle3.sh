#!/bin/sh
# Recipe: an EAGLE-3 head for qwen2.5-coder-1.5b, trained on this CPU (resumable: run it again to continue;
# feature shards are cached under $VERISPEC_HOME/features and the checkpoint under OUT).
# Data: Python source from the installed site-packages (no overlap with the benchmark prompts).
# Started 2026-11-25 on a 2-core AMD EPYC (Zen 5); extraction ran at ~4-6 tok/s under a shared load, so the
# 61k-token feature set needs several hours there: it did not finish in that session.
set -e
OUT=${1:-heads/qwen2.5-coder-1.5b-eagle3}
exec nice -n 5 verispec train eagle3 --target qwen2.5-coder-1.5b --out "$OUT" \
  --max-tokens 61440 --draft-vocab 16000 --steps 400 --ttt-steps 3 --batch 1 --threads 1 --checkpoint-every 20 --lr 1e-3
