"""A draft's LM head over part of the vocabulary against the whole head, same prompts, same run.

`api.load_draft` gives a draft named beside a q8 target a head over the first 32k token ids, the special tokens
and every token of the text it has read (`NativeCausalLM.with_output_ids(..., reads=True)`). This times that
against the whole head and a 64k one: each prompt runs every variant twice, in alternating order, and each
variant's tokens/s (end to end) is divided by the whole head's. Greedy: outputs must be identical.

    python bench/draft_vocab_ab.py --drafter staged --draft-len auto --out bench/reports/draft_vocab_ab_staged.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import verispec
from verispec.api import load_draft
from verispec.bench import _cpu_name, read_prompts
from verispec.text import encode_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--drafter", default="staged", help="staged or model")
    parser.add_argument("--draft-len", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--data", default="../shared/data", help="folder with humaneval_dev.jsonl and spec_bench_dev.jsonl")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    draft_len = args.draft_len if args.draft_len == "auto" else int(args.draft_len)

    target = verispec.load(args.target, numerics="q8")
    variants = {"whole": load_draft(args.draft, target, vocab=None), "64k+read": load_draft(args.draft, target, vocab=65536),
                "32k+read": load_draft(args.draft, target, vocab=32768)}
    data = Path(args.data)
    # every other prompt of HumanEval's first 6 and of Spec-Bench's first of each category
    prompts = read_prompts(str(data / "humaneval_dev.jsonl"), 6)[::2] + read_prompts(str(data / "spec_bench_dev.jsonl"), 1)[::2]
    rows = []
    for prompt in prompts:
        ids = encode_prompt(target.tokenizer, prompt.text, chat=prompt.chat)
        runs = {name: [] for name in variants}
        for round_ in range(2):
            for name in (list(variants) if round_ == 0 else list(variants)[::-1]):
                result = verispec.generate(target, ids, draft=variants[name], drafter=args.drafter, draft_len=draft_len,
                                           max_new_tokens=args.max_new_tokens)
                stats = result.stats
                runs[name].append({"tokens_per_second": len(result.token_ids) / stats.total_seconds,
                                   "tokens_per_pass": stats.mean_accepted_tokens,
                                   "draft_ms_per_pass": 1e3 * stats.draft_seconds / max(1, stats.target_passes),
                                   "tokens": result.token_ids})
        whole = statistics.median(r["tokens_per_second"] for r in runs["whole"])
        row = {"category": prompt.category, "id": prompt.id}
        for name, got in runs.items():
            row[name] = {"vs_whole": statistics.median(r["tokens_per_second"] for r in got) / whole,
                         "tokens_per_pass": statistics.median(r["tokens_per_pass"] for r in got),
                         "draft_ms_per_pass": statistics.median(r["draft_ms_per_pass"] for r in got),
                         "identical": all(r["tokens"] == runs["whole"][0]["tokens"] for r in got)}
        rows.append(row)
        print(f"{prompt.category:14s} " + " | ".join(
            f"{name} {row[name]['vs_whole']:.2f}x ({row[name]['tokens_per_pass']:.2f}/pass, draft {row[name]['draft_ms_per_pass']:.0f} ms/pass)"
            for name in variants), flush=True)
    summary = {name: {"median": statistics.median(r[name]["vs_whole"] for r in rows),
                      "geomean": statistics.geometric_mean(r[name]["vs_whole"] for r in rows),
                      "identical": f"{sum(r[name]['identical'] for r in rows)}/{len(rows)}"} for name in variants}
    print(json.dumps(summary, indent=1))
    report = {"cpu": _cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "settings": vars(args), "summary": summary, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    plot(report, Path(args.out).with_suffix(".png"))


def plot(report: dict, path: Path) -> None:
    """Each prompt's tokens/s against the whole head's, one bar per head variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    variants = [name for name in rows[0] if name not in ("category", "id")]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(variants)
    for i, name in enumerate(variants):
        ax.bar([x + i * width for x in range(len(rows))], [r[name]["vs_whole"] for r in rows], width,
               label=f"{name} (median {report['summary'][name]['median']:.2f}x)")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ratios = [r[name]["vs_whole"] for r in rows for name in variants]
    ax.set_ylim(min(0.8, min(ratios) - 0.05), max(ratios) + 0.15)
    ax.set_xticks([x + width * (len(variants) - 1) / 2 for x in range(len(rows))])
    ax.set_xticklabels([r["category"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("tokens/s vs the whole head")
    settings = report["settings"]
    ax.set_title(f"{settings['draft']} (Q4_0) drafting for {settings['target']} (q8), {settings['drafter']}, "
                 f"{report['cpu']}, {report['date']}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", ncol=len(variants))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
