"""`auto` with a draft model: how much of the prompt the draft reads, measured.

A draft model reads the prompt before it drafts (its prefill), a cost the call pays whatever the answer's length.
On a long prompt with a short answer (Spec-Bench's extraction, RAG, QA) that prefill is what keeps `auto` below
plain decoding. `ModelDrafter(context=N)` reads only the prompt's last N tokens (`api.DRAFT_CONTEXT`): a
cheaper start, bought with what the draft no longer sees. This times contexts against each other, beside plain
decoding, on every Spec-Bench dev category's first prompt (odd rows) and HumanEval dev prompts: "full" (the whole
prompt) and "lastN". Each prompt runs every variant `--rounds` times in alternating order; each variant's tokens/s
(end to end, prefill included) is divided by plain decoding's. Greedy: outputs must be identical.

    python bench/draft_context_ab.py --contexts full,64,128,256 --out bench/reports/draft_context_ab.json
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import verispec
import verispec.api
from verispec.api import load_draft
from verispec.bench import _cpu_name, read_prompts
from verispec.text import encode_prompt

from ab import arguments, compare, plot_ratios, run_interleaved, summarize


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="full,128", help="comma-separated: full, or a token count")
    parser.add_argument("--humaneval", type=int, default=3, help="HumanEval dev prompts (odd rows)")
    parser.add_argument("--prompts", type=int, default=None, help="only the first N prompts (a smoke run)")
    args = parser.parse_args()

    target = verispec.load(args.target, numerics="q8")
    draft = load_draft(args.draft, target)
    variants = {"plain": (dict(drafter="none"), None)}
    for name in args.contexts.split(","):
        context = None if name == "full" else int(name)
        variants["auto, full prompt" if context is None else f"auto, last {context}"] = (dict(draft=draft), context)
    data = Path(args.data)
    prompts = read_prompts(str(data / "spec_bench_dev.jsonl"), 1) + read_prompts(str(data / "humaneval_dev.jsonl"), args.humaneval)
    prompts = prompts[: args.prompts]
    names = list(variants)
    rows = []
    try:
        for prompt in prompts:
            ids = encode_prompt(target.tokenizer, prompt.text, chat=prompt.chat)

            def run(name: str) -> dict:
                options, context = variants[name]
                verispec.api.DRAFT_CONTEXT = context
                result = verispec.generate(target, ids, max_new_tokens=args.max_new_tokens, **options)
                stats = result.stats
                return {"tokens_per_second": len(result.token_ids) / stats.total_seconds,
                        "tokens_per_pass": stats.mean_accepted_tokens, "prefill_seconds": stats.prefill_seconds,
                        "drafter": stats.drafter, "tokens": result.token_ids}

            runs = run_interleaved(names, args.rounds, run)
            row = {"category": prompt.category, "id": prompt.id, "prompt_tokens": len(ids),
                   "new_tokens": len(runs["plain"][0]["tokens"]),
                   "plain_tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs["plain"]),
                   **compare(runs, "plain", "vs_plain", ("tokens_per_pass", "prefill_seconds"))}
            for name, got in runs.items():
                row[name]["drafter"] = got[-1]["drafter"]
            rows.append(row)
            print(f"{prompt.category:14s} {row['prompt_tokens']:4d}+{row['new_tokens']:3d} " + " | ".join(
                f"{name} {row[name]['vs_plain']:.2f}x {row[name]['tokens_per_pass']:.2f}/pass" for name in names if name != "plain")
                + f"  ({row[names[-1]]['drafter']})", flush=True)
    finally:
        verispec.api.DRAFT_CONTEXT = None
    summary = summarize(rows, names, "vs_plain")
    print(json.dumps(summary, indent=1))
    report = {"cpu": _cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "settings": vars(args), "summary": summary, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot_ratios(rows, summary, [name for name in names if name != "plain"], "vs_plain",
                [f"{r['category']}\n{r['prompt_tokens']}+{r['new_tokens']}" for r in rows], "tokens/s vs plain (end to end)",
                f"{args.target} (q8) with {args.draft}: how much of the prompt the draft reads; {report['cpu']}, {report['date']}",
                Path(args.out).with_suffix(".png"), floor=0.97)


if __name__ == "__main__":
    main()
