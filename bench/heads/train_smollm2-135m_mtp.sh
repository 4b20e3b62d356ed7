#!/bin/sh
# Recipe: the DeepSeek-V3-style MTP module for smollm2-135m measured in bench/README.md (2026-11-26), trained
# on this CPU in minutes. Resumable: run it again to continue (feature shards and the checkpoint are kept).
#
# Data: Python source of the installed site-packages, teacher-forced (the default); 61,440 tokens of features
# (the target's final hidden state after its final norm, and its top-32 log-probabilities), the last of
# fifteen 4,096-token shards held out. The module: draft vocabulary 8192 (the target's LM head rows for
# them), the target's MLP width (1536), 4 training-time-test steps, 240 steps of 4 sequences, lr 2e-3,
# bfloat16 autocast where the CPU has it. About 15 min of extraction (~70 tokens/s on 2 quiet cores) and
# 6 of training.
set -e
OUT=${1:-heads/smollm2-135m-mtp}
exec nice -n 5 verispec train mtp --target smollm2-135m --out "$OUT" --max-tokens 61440 --seq-len 256 \
  --draft-vocab 8192 --steps 240 --batch 4 --ttt-steps 4 --lr 2e-3 --checkpoint-every 40 --threads 2
