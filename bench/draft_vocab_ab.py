"""A draft's LM head over part of the vocabulary against the whole head, same prompts, same run.

`api.load_draft` gives a draft named beside a q8 target a head over the first 32k token ids, the special tokens
and every token of the text it has read (`NativeCausalLM.with_output_ids(..., reads=True)`). This times that
against the whole head and a 64k one: each prompt runs every variant twice, in alternating order, and each
variant's tokens/s (end to end) is divided by the whole head's. Greedy: outputs must be identical.

    python bench/draft_vocab_ab.py --drafter staged --draft-len auto --out bench/reports/draft_vocab_ab_staged.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import verispec
from verispec.api import load_draft
from verispec.bench import _cpu_name, read_prompts
from verispec.text import encode_prompt

from ab import arguments, compare, forget_outputs, plot_ratios, run_interleaved, summarize


def main() -> None:
    parser = arguments(__doc__.splitlines()[0], rounds=False)
    parser.add_argument("--drafter", default="staged", help="staged or model")
    parser.add_argument("--draft-len", default="auto")
    args = parser.parse_args()
    draft_len = args.draft_len if args.draft_len == "auto" else int(args.draft_len)

    target = verispec.load(args.target, numerics="q8")
    variants = {"whole": load_draft(args.draft, target, vocab=None), "64k+read": load_draft(args.draft, target, vocab=65536),
                "32k+read": load_draft(args.draft, target, vocab=32768)}
    data = Path(args.data)
    # every other prompt of HumanEval's first 6 and of Spec-Bench's first of each category
    prompts = read_prompts(str(data / "humaneval_dev.jsonl"), 6)[::2] + read_prompts(str(data / "spec_bench_dev.jsonl"), 1)[::2]
    names = list(variants)
    rows = []
    for prompt in prompts:
        ids = encode_prompt(target.tokenizer, prompt.text, chat=prompt.chat)

        def run(name: str) -> dict:
            forget_outputs(target)
            result = verispec.generate(target, ids, draft=variants[name], drafter=args.drafter, draft_len=draft_len,
                                       max_new_tokens=args.max_new_tokens)
            stats = result.stats
            return {"tokens_per_second": len(result.token_ids) / stats.total_seconds,
                    "tokens_per_pass": stats.mean_accepted_tokens,
                    "draft_ms_per_pass": 1e3 * stats.draft_seconds / max(1, stats.target_passes),
                    "tokens": result.token_ids}

        runs = run_interleaved(names, 2, run)
        row = {"category": prompt.category, "id": prompt.id,
               **compare(runs, "whole", "vs_whole", ("tokens_per_pass", "draft_ms_per_pass"))}
        rows.append(row)
        print(f"{prompt.category:14s} " + " | ".join(
            f"{name} {row[name]['vs_whole']:.2f}x ({row[name]['tokens_per_pass']:.2f}/pass, draft {row[name]['draft_ms_per_pass']:.0f} ms/pass)"
            for name in names), flush=True)
    summary = summarize(rows, names, "vs_whole")
    print(json.dumps(summary, indent=1))
    report = {"cpu": _cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "settings": vars(args), "summary": summary, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot_ratios(rows, summary, names, "vs_whole", [r["category"] for r in rows], "tokens/s vs the whole head",
                f"{args.draft} (Q4_0) drafting for {args.target} (q8), {args.drafter}, {report['cpu']}, {report['date']}",
                Path(args.out).with_suffix(".png"))


if __name__ == "__main__":
    main()
