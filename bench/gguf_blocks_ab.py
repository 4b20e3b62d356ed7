"""Float32 matrices against the exact GGUF blocks, plain and speculative, interleaved per prompt.

The four runs of each HumanEval prompt (float32 plain, float32 speculative, blocks plain, blocks
speculative) run back to back, so a shared machine's load hits all four alike; prints per-prompt
seconds, whether all four outputs are identical, and medians. Usage: python bench/gguf_blocks_ab.py [new tokens]
Output of the 2026-11-23 run: bench/reports/gguf_blocks_ab.log.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import verispec
torch.set_num_threads(2)
n_tok = int(sys.argv[1]) if len(sys.argv) > 1 else 96
f32 = verispec.load("qwen2.5-coder-1.5b", gguf_blocks=False)
gg = verispec.load("qwen2.5-coder-1.5b", gguf_blocks=True)
draft = verispec.load("qwen2.5-coder-0.5b", weight_dtype="int4")
prompts = [json.loads(l)["prompt"] for l in open(str(Path(__file__).resolve().parents[1].parent / "shared" / "data" / "humaneval_dev.jsonl"))][:5]
warm = "def f(x):\n    return x + 1\n\n" * 8
for m in (f32, gg):
    verispec.generate(m, warm, drafter="none", max_new_tokens=4); verispec.generate(m, warm, draft=draft, max_new_tokens=4)
rows = []
for p in prompts:
    r = {}
    for name, m in (("f32", f32), ("gguf", gg)):
        for mode in ("plain", "spec"):
            t = time.perf_counter()
            out = verispec.generate(m, p, draft=draft if mode == "spec" else None, drafter="none" if mode == "plain" else "auto", max_new_tokens=n_tok)
            r[f"{name}_{mode}"] = time.perf_counter() - t
            r[f"{name}_{mode}_ids"] = out.token_ids
    same = len({tuple(r[k]) for k in r if k.endswith("_ids")}) == 1
    print({k: round(v, 2) for k, v in r.items() if not k.endswith("_ids")}, "identical" if same else "DIFFERENT", flush=True)
    rows.append(r)
med = lambda k: statistics.median(x[k] for x in rows)
for k in ("f32_plain", "f32_spec", "gguf_plain", "gguf_spec"):
    print(k, round(med(k), 2), "s median")
print("spec/plain f32", round(statistics.median(x["f32_plain"] / x["f32_spec"] for x in rows), 2),
      "gguf", round(statistics.median(x["gguf_plain"] / x["gguf_spec"] for x in rows), 2),
      "gguf spec vs f32 spec", round(statistics.median(x["f32_spec"] / x["gguf_spec"] for x in rows), 2),
      "gguf plain vs f32 plain", round(statistics.median(x["f32_plain"] / x["gguf_plain"] for x in rows), 2))
