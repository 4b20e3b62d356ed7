"""Suffix decoding on a repeated-task workload: the same HumanEval tasks asked twice, the second time
with a small change, against per-request prompt lookup (ngram) and plain decoding, in one run.

Round 1 asks each task as bundled; round 2 asks it again with a comment line added at the top (a
retried or slightly edited request, as agents and code-editing tools send). Per prompt the three
drafters run back to back (plain, ngram, suffix), so a noisy neighbour hits all three alike; the
speedups are medians of the per-prompt ratios. Greedy: every drafter's text must equal plain decoding.

    python bench/suffix_repeat.py --target qwen2.5-coder-0.5b --out bench/reports/suffix_qwen05.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import verispec
from verispec.bench import read_prompts
from verispec.text import encode_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-0.5b")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-len", default="auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    draft_len = args.draft_len if args.draft_len == "auto" else int(args.draft_len)

    target = verispec.load(args.target)
    tasks = read_prompts("humaneval", args.prompts)[: args.prompts]
    rounds = {"first": [t.text for t in tasks], "changed": [f"# Task {i}, asked again\n" + t.text for i, t in enumerate(tasks)]}
    warm = encode_prompt(target.tokenizer, "def f(x):\n    return x + 1\n", chat=False)
    for drafter in ("none", "ngram", "suffix"):
        verispec.generate(target, warm, drafter=drafter, max_new_tokens=8)
    verispec.api.suffix_index(target).__init__()  # an empty index: the warm-up's output is not part of the run

    rows = []
    for round_name, texts in rounds.items():
        for i, text in enumerate(texts):
            ids = encode_prompt(target.tokenizer, text, chat=False)
            row = {"round": round_name, "task": tasks[i].id}
            for drafter in ("none", "ngram", "suffix"):
                started = time.perf_counter()
                result = verispec.generate(target, ids, drafter=drafter, draft_len=draft_len, max_new_tokens=args.max_new_tokens)
                seconds = time.perf_counter() - started
                row[drafter] = {"seconds": round(seconds, 3), "tokens": len(result.token_ids),
                                "tokens_per_pass": round(result.stats.mean_accepted_tokens, 3),
                                "acceptance": round(result.stats.acceptance_rate, 3), "ids": result.token_ids}
            row["same_text"] = row["ngram"]["ids"] == row["none"]["ids"] == row["suffix"]["ids"]
            for drafter in ("none", "ngram", "suffix"):
                del row[drafter]["ids"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.out:  # what is measured so far, should the run be cut short
                with open(args.out, "w") as f:
                    json.dump({"target": args.target, "partial": True, "rows": rows}, f, indent=1)

    summary = {}
    for round_name in rounds:
        mine = [r for r in rows if r["round"] == round_name]
        summary[round_name] = {
            "speedup_ngram": round(statistics.median(r["none"]["seconds"] / r["ngram"]["seconds"] for r in mine), 3),
            "speedup_suffix": round(statistics.median(r["none"]["seconds"] / r["suffix"]["seconds"] for r in mine), 3),
            "suffix_over_ngram": round(statistics.median(r["ngram"]["seconds"] / r["suffix"]["seconds"] for r in mine), 3),
            "tokens_per_pass_ngram": round(statistics.median(r["ngram"]["tokens_per_pass"] for r in mine), 3),
            "tokens_per_pass_suffix": round(statistics.median(r["suffix"]["tokens_per_pass"] for r in mine), 3),
            "all_same_text": all(r["same_text"] for r in mine),
        }
    report = {"target": args.target, "max_new_tokens": args.max_new_tokens, "draft_len": args.draft_len,
              "prompts": len(tasks), "torch_threads": torch.get_num_threads(), "summary": summary, "rows": rows}
    print(json.dumps(summary, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
