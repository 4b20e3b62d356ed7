"""What drafting across tokenizers buys: plain decoding against a draft model with another tokenizer.

For each prompt, in one process and back to back (the order rotating per prompt, so neither side always
meets the state the other left): plain greedy decoding, then `CrossTokenizerDrafter` at a fixed draft length
and at draft_len="auto". Reports tokens per target pass, acceptance, identity with plain decoding and the
speed ratio (tokens per second over plain's, the prompt prefill included: a draft model pays its own).

    PYTHONPATH=src python bench/cross_tokenizer.py --target qwen2.5-coder-0.5b --draft smollm2-135m \
        --humaneval /work/shared/data/humaneval_dev.jsonl --spec-bench /work/shared/data/spec_bench_dev.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import verispec
from verispec.text import encode_prompt


def prompts(humaneval: str, spec_bench: str, per_set: int, categories: list[str]) -> list[tuple[str, str, bool]]:
    """(label, text, chat): odd-indexed rows of the HumanEval dev set; of Spec-Bench's dev set, the first
    odd-indexed row of each category asked for."""
    out = []
    rows = [json.loads(line) for line in open(humaneval)]
    out += [(row["task_id"], row["prompt"], False) for i, row in enumerate(rows) if i % 2 == 1][:per_set]
    rows = [json.loads(line) for line in open(spec_bench)]
    for category in categories[:per_set]:
        row = next(r for i, r in enumerate(rows) if i % 2 == 1 and r["category"] == category)
        out.append((f"{category}/{row['question_id']}", row["turns"][0], True))
    return out


def run(target, ids, **options):
    start = time.perf_counter()
    result = verispec.generate(target, ids, **options)
    return result, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-0.5b")
    p.add_argument("--draft", default="smollm2-135m")
    p.add_argument("--humaneval", default="/work/shared/data/humaneval_dev.jsonl")
    p.add_argument("--spec-bench", default="/work/shared/data/spec_bench_dev.jsonl")
    p.add_argument("--per-set", type=int, default=3)
    p.add_argument("--categories", default="coding,translation,qa")
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="JSON results here")
    args = p.parse_args()

    target, draft = verispec.load(args.target), verispec.load(args.draft)
    warm = encode_prompt(target.tokenizer, "def f(x):\n    return x + 1\n", chat=False)
    verispec.generate(target, warm, drafter="none", max_new_tokens=4)
    verispec.generate(target, warm, draft=draft, drafter="model", draft_len=args.draft_len, max_new_tokens=4)
    methods = {
        "plain": dict(drafter="none"),
        f"k={args.draft_len}": dict(draft=draft, drafter="model", draft_len=args.draft_len),
        "auto": dict(draft=draft, drafter="model", draft_len="auto"),
    }
    rows = []
    for n, (label, text, chat) in enumerate(prompts(args.humaneval, args.spec_bench, args.per_set, args.categories.split(","))):
        ids = encode_prompt(target.tokenizer, text, chat=chat)
        order = list(methods)[n % 3 :] + list(methods)[: n % 3]
        measured = {}
        for name in order:
            result, seconds = run(target, ids, max_new_tokens=args.max_new_tokens, **methods[name])
            measured[name] = (result, seconds)
        plain, plain_seconds = measured["plain"]
        row = {"prompt": label, "prompt_tokens": len(ids), "tokens": len(plain.token_ids), "plain_seconds": plain_seconds}
        for name in list(methods)[1:]:
            result, seconds = measured[name]
            stats = result.stats
            row[name] = {"seconds": seconds, "identical": result.token_ids == plain.token_ids, "drafter": stats.drafter,
                         "tokens_per_pass": stats.mean_accepted_tokens, "acceptance": stats.acceptance_rate,
                         "speed_ratio": (len(result.token_ids) / seconds) / (len(plain.token_ids) / plain_seconds)}
        rows.append(row)
        print(f"[cross_tokenizer] {label}: plain {row['tokens']} tokens in {plain_seconds:.1f}s; "
              + "; ".join(f"{name}: {row[name]['tokens_per_pass']:.2f} tok/pass, {row[name]['speed_ratio']:.2f}x, "
                          f"identical={row[name]['identical']}, {row[name]['drafter']}" for name in list(methods)[1:]),
              file=sys.stderr, flush=True)
    report = {"target": args.target, "draft": args.draft, "max_new_tokens": args.max_new_tokens, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
