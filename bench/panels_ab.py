"""Row-major float32 matrices against `PanelMatrix` panels, plain and speculative, interleaved per prompt.

Both native forwards of the Qwen2.5-Coder 1.5B target run in one process on the same transformers
weights (rows borrows them, panels keeps its copy: ~16 GB in all with the int4 draft). For each of the
first 5 HumanEval dev prompts the four runs (rows plain, rows speculative, panels plain, panels
speculative; the halves swapped on every other prompt) go back to back, so the shared machine's load
hits them alike. Prints per-prompt seconds, the ratios, whether speculative equals plain and rows
equals panels token for token, and medians. Usage: python bench/panels_ab.py [new tokens]
Output of the 2026-11-24 run: bench/reports/panels_ab.log.
"""
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import verispec
from verispec.models.native import NativeCausalLM

torch.set_num_threads(2)
new_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 96
hf = verispec.load("qwen2.5-coder-1.5b", backend="hf")
targets = {"rows": NativeCausalLM.from_hf(hf, panels=False), "panels": NativeCausalLM.from_hf(hf, panels=True)}
draft = verispec.load("qwen2.5-coder-0.5b", weight_dtype="int4")
data = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "humaneval_dev.jsonl"
prompts = [json.loads(line)["prompt"] for line in open(data)][:5]
for target in targets.values():  # warm: kernels built, buffers sized, costs measured once
    verispec.generate(target, "def f(x):", draft=draft, max_new_tokens=8)
lines = []
for i, prompt in enumerate(prompts):
    order = [("rows", "none"), ("rows", "model"), ("panels", "none"), ("panels", "model")]
    order = order[2:] + order[:2] if i % 2 else order
    seconds, tokens = {}, {}
    for name, drafter in order:
        start = time.perf_counter()
        result = verispec.generate(targets[name], prompt, draft=draft if drafter == "model" else None, drafter=drafter,
                                   max_new_tokens=new_tokens)
        seconds[name, drafter], tokens[name, drafter] = time.perf_counter() - start, result.token_ids
    line = {f"{name}/{drafter}": round(s, 2) for (name, drafter), s in seconds.items()}
    line["speedup_rows"] = round(seconds["rows", "none"] / seconds["rows", "model"], 3)
    line["speedup_panels"] = round(seconds["panels", "none"] / seconds["panels", "model"], 3)
    line["plain_panels_over_rows"] = round(seconds["rows", "none"] / seconds["panels", "none"], 3)
    line["spec_panels_over_rows"] = round(seconds["rows", "model"] / seconds["panels", "model"], 3)
    line["spec_equals_plain"] = all(tokens[n, "none"] == tokens[n, "model"] for n in targets)
    line["rows_equal_panels"] = tokens["rows", "none"] == tokens["panels", "none"]
    lines.append(line)
    print(line, flush=True)
for key in ("speedup_rows", "speedup_panels", "plain_panels_over_rows", "spec_panels_over_rows"):
    print(f"median {key}: {statistics.median(line[key] for line in lines):.3f}")
