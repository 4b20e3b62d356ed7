"""The quantized matrices on huge pages against plain 4 KB pages, same prompts, same run.

`kernels.pages` puts the repacked blocks of a q8 target and of its draft on 2 MB pages (`KernelConfig.huge_pages`,
`VERISPEC_HUGE_PAGES=0` turns it off). This loads the Qwen pair twice, once each way, and runs plain decoding and
the default mode (`auto` with the 0.5B draft) on HumanEval dev odd rows x5 and Spec-Bench dev odd rows x1: each
prompt runs every variant `--rounds` times in alternating order. Reported per prompt: each arm's tokens/s (end to
end) over the 4 KB arm's, for plain and for auto; greedy outputs must be identical to the 4 KB arm's.

    python bench/huge_pages_ab.py --out bench/reports/huge_pages_ab.json
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import verispec
from verispec import api, race
from verispec.bench import _cpu_name
from verispec.models.kernels import config as kernel_config
from verispec.text import encode_prompt

from ab import arguments, compare, plot_ratios, run_interleaved, summarize


def load_arm(args, huge: bool):
    """The target and the `auto` method's options, loaded with huge pages on or off (fresh objects either way)."""
    kernel_config.configure(kernel_config.KernelConfig.from_env({"VERISPEC_HUGE_PAGES": "1" if huge else "0"}))
    api._LOADED.clear()  # the other arm's objects stay alive in this script; new ones are made
    target = verispec.load(args.target, numerics="q8")
    auto = race.methods_of(target, [f"auto:{args.draft}"])[-1]
    race.run_method(target, race.warm_prompt(target), auto, 16)  # as a race warms up: the costs measured once
    return target, auto


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    args = parser.parse_args()
    arms = {"4k": load_arm(args, huge=False), "huge": load_arm(args, huge=True)}
    kernel_config.configure(kernel_config.KernelConfig.from_env())
    data = Path(args.data)
    prompts = (race.race_prompts(str(data / "humaneval_dev.jsonl"), "odd", 5)
               + race.race_prompts(str(data / "spec_bench_dev.jsonl"), "odd", 1))
    variants = [f"{mode} {arm}" for mode in ("plain", "auto") for arm in arms]
    rows = []
    for prompt in prompts:
        def run(name: str) -> dict:
            mode, arm = name.split()
            target, auto = arms[arm]
            ids = encode_prompt(target.tokenizer, prompt.text, chat=prompt.chat)
            method = auto if mode == "auto" else race.Method("plain", dict(drafter="none"))
            result, seconds = race.run_method(target, ids, method, args.max_new_tokens)
            return {"tokens_per_second": len(result.token_ids) / seconds, "tokens": result.token_ids,
                    "tokens_per_pass": result.stats.mean_accepted_tokens}

        runs = run_interleaved(variants, args.rounds, run)
        row = {"category": prompt.category, "id": prompt.id}
        for mode in ("plain", "auto"):
            got = compare({arm: runs[f"{mode} {arm}"] for arm in arms}, "4k", "vs_4k", ("tokens_per_second", "tokens_per_pass"))
            row.update({f"{mode} {arm}": got[arm] for arm in arms})
        row["plain_equals_auto"] = runs["plain 4k"][0]["tokens"] == runs["auto huge"][0]["tokens"]
        rows.append(row)
        print(f"{prompt.category:14s} plain huge {row['plain huge']['vs_4k']:.2f}x ({row['plain 4k']['tokens_per_second']:.1f} tok/s on 4k) "
              f"| auto huge {row['auto huge']['vs_4k']:.2f}x ({row['auto 4k']['tokens_per_second']:.1f} tok/s on 4k, "
              f"{row['auto 4k']['tokens_per_pass']:.2f}/pass) | identical {row['plain huge']['identical'] and row['auto huge']['identical'] and row['plain_equals_auto']}",
              flush=True)
    measured = ["plain huge", "auto huge"]
    summary = summarize(rows, measured, "vs_4k")
    print(json.dumps(summary, indent=1))
    report = {"settings": {"target": args.target, "draft": args.draft, "max_new_tokens": args.max_new_tokens,
                           "rounds": args.rounds, "cpu": _cpu_name(), "threads": 2,
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
              "summary": summary, "rows": rows}
    out = Path(args.out)
    for row in rows:
        for name in variants:
            row[name].pop("tokens", None)
    out.write_text(json.dumps(report, indent=1))
    plot_ratios(rows, summary, measured, "vs_4k", [f"{r['category']}/{r['id']}" for r in rows],
                "tokens/s over 4 KB pages (end to end)",
                f"q8 {args.target} and the {args.draft} draft, repacked blocks on 2 MB pages against 4 KB; {_cpu_name()}",
                out.with_suffix(".png"), floor=0.97)


if __name__ == "__main__":
    main()
