"""`auto` with a draft model: when a one-row call starts the draft, measured.

A one-row call of `drafter="auto"` with a draft model may draft its first answer tokens by prompt lookup and have
the draft model read the prompt only then (`DecodeBatch._start_late`), so a short answer need not pay the draft's
prefill. How long it waits is `policy.start_after`: fitted to the answers the process has seen (the default). This
times waits against each other, beside plain decoding and prompt lookup alone, on every Spec-Bench dev category's
first prompt and three HumanEval dev prompts: "at-once" (no wait: the behaviour before 2026-11-27), "fitted" (the
default), "ski" (the history-free ski rental: wait until a 2x draft's forgone savings equal the prefill's price,
at most 32 tokens) and "fixedN" (N tokens). Each prompt runs every variant `--rounds` times in alternating order;
each variant's tokens/s (end to end, prefill included) is divided by plain decoding's. Greedy: outputs must be
identical. `--retreats 16,8` adds variants with the fitted wait whose draft model is judged (`policy.RETREAT_STEPS`:
given up for prompt lookup where it is slower than plain steps) after that many steps instead.

    python bench/late_start_ab.py --waits at-once,ski --out bench/reports/late_start_ab.json
    python bench/late_start_ab.py --waits fitted --retreats 8 --out bench/reports/retreat_ab.json
"""

from __future__ import annotations

import math
from pathlib import Path

import verispec
import verispec.engine
from verispec.api import load_draft
from verispec.bench import read_prompts
from verispec.policy import RETREAT_STEPS, START_SPEEDUP, start_after

from ab import arguments, report_against_plain, rows_against_plain


def wait_rule(name: str):
    """`policy.start_after`'s signature -> a wait in answer tokens, by name (see the module docstring)."""
    if name == "at-once":
        return lambda startup, step, answers, most: 0
    if name == "fitted":
        return start_after
    if name == "ski":
        return lambda startup, step, answers, most: (
            0 if startup is None or step is None else min(most, math.ceil(startup / (step * (1 - 1 / START_SPEEDUP)))))
    if name.startswith("fixed") and name[5:].isdigit():
        return lambda startup, step, answers, most: int(name[5:])
    raise SystemExit(f"unknown wait {name!r}: at-once, fitted, ski or fixedN")


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--waits", default="at-once,fitted", help="comma-separated: at-once, fitted, ski, fixedN")
    parser.add_argument("--retreats", default="", help="comma-separated step counts: the fitted wait, judged after N steps")
    parser.add_argument("--prompts", type=int, default=None, help="only the first N prompts (a smoke run)")
    args = parser.parse_args()

    target = verispec.load(args.target, numerics="q8")
    draft = load_draft(args.draft, target)
    variants = {"plain": (dict(drafter="none"), start_after, RETREAT_STEPS),
                "ngram": (dict(drafter="ngram"), start_after, RETREAT_STEPS)}
    variants.update({f"auto, wait {name}": (dict(draft=draft), wait_rule(name), RETREAT_STEPS) for name in args.waits.split(",")})
    variants.update({f"auto, judged after {steps}": (dict(draft=draft), start_after, int(steps))
                     for steps in filter(None, args.retreats.split(","))})
    data = Path(args.data)
    prompts = read_prompts(str(data / "spec_bench_dev.jsonl"), 1) + read_prompts(str(data / "humaneval_dev.jsonl"), 6)[::2]
    names = list(variants)

    def options(name: str) -> dict:
        options, rule, steps = variants[name]
        verispec.engine.start_after, verispec.engine.RETREAT_STEPS = rule, steps
        return options

    try:
        rows = rows_against_plain(target, prompts[: args.prompts], names, args.rounds, args.max_new_tokens, options)
    finally:
        verispec.engine.start_after, verispec.engine.RETREAT_STEPS = start_after, RETREAT_STEPS
    report_against_plain(args, rows, names, "when auto starts the draft")


if __name__ == "__main__":
    main()
