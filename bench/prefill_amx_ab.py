"""A q8 target's prompt prefill on AMX tiles and in wider passes, against the VNNI tiles in 32-row passes, measured.

On a CPU with AMX-INT8 a Q4_K matrix's passes of 16 rows and more run on AMX tiles (csrc/kquant_amx.c, bitwise the
VNNI kernel's numbers), and a q8 model reads its prompt `kernels.Q8_MAX_ROWS` rows a pass (128; 32 before). This
times the variants against each other on every Spec-Bench dev category's first prompt and HumanEval dev prompts, with
the target's default drafting (`auto` with the 0.5B draft in Q4_0 blocks): each prompt runs every variant `--rounds`
times in alternating order; per variant the medians of its tokens/s end to end (prefill included) and of the
prompt's prefill (the target's, and the draft's where it starts with the call), each divided by the baseline's
(VNNI, 32 rows). Greedy: outputs must be identical.

    python bench/prefill_amx_ab.py --out bench/reports/prefill_amx_ab.json
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

import verispec
from verispec.api import load_draft
from verispec.bench import _cpu_name, read_prompts
from verispec.models import kernels
from verispec.models.kernels import config as kernel_config
from verispec.text import encode_prompt

from ab import arguments, compare, forget_outputs, plot_ratios, run_interleaved, summarize

VARIANTS = {"VNNI, 32 rows": (False, 32), "AMX, 32 rows": (True, 32), "AMX, 128 rows": (True, 128)}
BASELINE = "VNNI, 32 rows"


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--humaneval", type=int, default=4, help="HumanEval dev prompts (odd rows)")
    args = parser.parse_args()

    target = verispec.load(args.target, numerics="q8")
    if not kernels.amx():
        raise SystemExit("no AMX-INT8 tiles on this CPU (or VERISPEC_KERNEL_AMX=0): nothing to compare")
    draft = load_draft(args.draft, target)
    data = Path(args.data)
    prompts = read_prompts(str(data / "spec_bench_dev.jsonl"), 1) + read_prompts(str(data / "humaneval_dev.jsonl"), 2 * args.humaneval)[1::2]
    names = list(VARIANTS)
    settings, rows_per_pass = kernel_config.current(), kernels.Q8_MAX_ROWS
    rows = []
    try:
        for prompt in prompts:
            ids = encode_prompt(target.tokenizer, prompt.text, chat=prompt.chat)

            def run(name: str) -> dict:
                amx, width = VARIANTS[name]
                kernel_config.configure(dataclasses.replace(settings, amx=amx))
                kernels.Q8_MAX_ROWS = width
                assert kernels.amx() == amx
                forget_outputs(target)
                result = verispec.generate(target, ids, max_new_tokens=args.max_new_tokens, draft=draft)
                stats = result.stats
                return {"tokens_per_second": len(result.token_ids) / stats.total_seconds,
                        "prefill_tokens_per_second": stats.prompt_tokens_per_second,
                        "tokens_per_pass": stats.mean_accepted_tokens, "tokens": result.token_ids}

            runs = run_interleaved(names, args.rounds, run)
            row = {"category": prompt.category, "id": prompt.id, "prompt_tokens": len(ids),
                   "new_tokens": len(runs[BASELINE][0]["tokens"]),
                   **compare(runs, BASELINE, "vs_vnni", ("prefill_tokens_per_second", "tokens_per_pass"))}
            base_prefill = row[BASELINE]["prefill_tokens_per_second"]
            for name in names:
                row[name]["prefill_vs_vnni"] = row[name]["prefill_tokens_per_second"] / base_prefill
            rows.append(row)
            print(f"{prompt.category:14s} {row['prompt_tokens']:4d}+{row['new_tokens']:3d} " + " | ".join(
                f"{name} {row[name]['vs_vnni']:.2f}x (prefill {row[name]['prefill_vs_vnni']:.2f}x)"
                for name in names if name != BASELINE), flush=True)
    finally:
        kernel_config.configure(settings)
        kernels.Q8_MAX_ROWS = rows_per_pass
    others = [name for name in names if name != BASELINE]
    summary = {"end_to_end": summarize(rows, names, "vs_vnni"), "prefill": summarize(rows, names, "prefill_vs_vnni")}
    print(json.dumps(summary, indent=1))
    report = {"cpu": _cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "settings": vars(args), "summary": summary, "rows": rows}
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=1))
    labels = [f"{r['category']}\n{r['prompt_tokens']}+{r['new_tokens']}" for r in rows]
    plot_ratios(rows, summary["end_to_end"], others, "vs_vnni", labels, "tokens/s vs VNNI, 32 rows (end to end)",
                f"{args.target} (q8), auto with {args.draft} (Q4_0): AMX prefill; {report['cpu']}, {report['date']}", out.with_suffix(".png"))
    plot_ratios(rows, summary["prefill"], others, "prefill_vs_vnni", labels, "prefill tokens/s vs VNNI, 32 rows",
                f"{args.target} (q8) prompt prefill (target and draft): AMX tiles, pass width; {report['cpu']}, {report['date']}",
                out.with_name(out.stem + "_prefill.png"))


if __name__ == "__main__":
    main()
