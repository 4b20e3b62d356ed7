"""Where a speculative decoding call's time goes, step by step and pass by pass.

The speedup formula E / (k c + v(k + 1)) has three measured terms, and a race reports only their product. This
runs the engine on real prompts (one method, as `verispec bench --method` names it) and times every forward pass
of the target and of the draft model by width, as the engine makes them, and reads every step's record: how wide
the verify pass was, how many tokens it kept, what drafting and verifying cost. It reports, per verify width,
the steps that had it and the tokens per second they delivered; per prompt, the seconds spent drafting,
verifying and elsewhere (prefills, the step's own work); and each model's pass cost by width.

    python bench/step_profile.py ../shared/data/humaneval_dev.jsonl --target qwen2.5-coder-1.5b --numerics q8 \\
        --method auto:qwen2.5-coder-0.5b --rows odd --per-category 5 --out bench/reports/step_profile_humaneval

Writes OUT.json and OUT.png (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

import torch

import verispec
from verispec import race
from verispec.api import Session, suffix_index
from verispec.bench import _cpu_name
from verispec.stats import SpecStats
from verispec.text import encode_prompt


class PassTimer:
    """Times every forward of one model object by its width (tokens per row), while installed."""

    def __init__(self, model, max_width: int = 16):
        self.model, self.max_width = model, max_width
        self.seconds: dict[int, list[float]] = defaultdict(list)
        self._forward = model.forward

    def __enter__(self) -> "PassTimer":
        def timed(tokens, *args, **kwargs):
            started = time.perf_counter()
            out = self._forward(tokens, *args, **kwargs)
            if tokens.shape[-1] <= self.max_width:  # prefills are counted as what they are: not steps
                self.seconds[int(tokens.shape[-1])].append(time.perf_counter() - started)
            return out

        self.model.forward = timed
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward  # the class's method again

    def table(self) -> dict[int, dict]:
        return {w: {"passes": len(s), "median_ms": 1e3 * statistics.median(s), "total_s": sum(s)}
                for w, s in sorted(self.seconds.items())}


class StepLog(SpecStats):
    """A call's stats that also keep each step: (width, accepted, draft seconds, verify seconds)."""

    def __init__(self):
        super().__init__()
        self.steps: list[tuple[int, int, float, float]] = []

    def observe(self, step) -> None:
        self.steps.append((step.width, int(step.num_accepted[0]), step.draft_seconds, step.target_seconds))
        super().observe(step)


def profile_call(target, ids: list[int], options: dict, max_new_tokens: int) -> tuple[dict, list]:
    """One call: its totals and its steps."""
    suffix_index(target).clear()  # drafts from this call's text only, as a race's calls do
    started = time.perf_counter()
    session = Session(target, ids, max_new_tokens=max_new_tokens, **options)
    session.stats = StepLog()
    tokens = sum(len(event.tokens) for event in session.events())
    seconds = time.perf_counter() - started
    steps = session.stats.steps
    draft, verify = sum(s[2] for s in steps), sum(s[3] for s in steps)
    return {"prompt_tokens": len(ids), "tokens": tokens, "seconds": seconds, "steps": len(steps),
            "draft_seconds": draft, "verify_seconds": verify, "other_seconds": seconds - draft - verify,
            "prefill_seconds": session.stats.prefill_seconds}, steps


def by_width(steps: list) -> dict[int, dict]:
    groups = defaultdict(list)
    for width, accepted, draft, verify in steps:
        groups[width].append((accepted, draft, verify))
    out = {}
    for width, rows in sorted(groups.items()):
        tokens, seconds = sum(a + 1 for a, _, _ in rows), sum(d + v for _, d, v in rows)
        out[width] = {"steps": len(rows), "tokens": tokens, "accepted_mean": statistics.mean(a for a, _, _ in rows),
                      "draft_ms": 1e3 * statistics.mean(d for _, d, _ in rows),
                      "verify_ms": 1e3 * statistics.mean(v for _, _, v in rows), "tokens_per_second": tokens / seconds}
    return out


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    widths = report["by_verify_width"]
    xs = [int(w) for w in widths]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    draft = [widths[w]["draft_ms"] for w in widths]
    verify = [widths[w]["verify_ms"] for w in widths]
    left.bar(xs, draft, label="drafting")
    left.bar(xs, verify, bottom=draft, label="verify pass")
    for x, d, v, w in zip(xs, draft, verify, widths.values()):
        left.annotate(f"{w['steps']}", (x, d + v), ha="center", va="bottom", fontsize=8)
    left.set(xlabel="verify pass width (1 + drafted tokens)", ylabel="ms per step (bar label: steps)",
             title="a step's time by its verify width")
    left.legend()
    tps = [widths[w]["tokens_per_second"] for w in widths]
    right.bar(xs, tps, color="tab:green")
    overall = report["totals"]["decode_tokens_per_second"]
    right.axhline(overall, color="k", ls="--", label=f"all steps: {overall:.1f} tok/s")
    right.set(xlabel="verify pass width", ylabel="tokens per second of those steps", title="what each width delivered")
    right.legend()
    settings, totals = report["settings"], report["totals"]
    fig.suptitle(f"{settings['method']} on {settings['target']} ({settings['numerics']}): {totals['tokens_per_step']:.2f} tokens "
                 f"a step over {totals['steps']} steps\n{settings['prompts']}; {settings['cpu']}, {settings['threads']} threads",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", help="a JSONL prompt file, or a bundled set (humaneval, spec_bench)")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--numerics", default="q8")
    parser.add_argument("--method", default="auto:qwen2.5-coder-0.5b", help="as `verispec bench --method` takes it")
    parser.add_argument("--draft-len", default="auto")
    parser.add_argument("--rows", choices=("all", "odd", "even"), default="all")
    parser.add_argument("--per-category", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", required=True, help="output path without extension")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    prompts = race.race_prompts(args.prompts, args.rows, args.per_category)
    target = verispec.load(args.target, numerics=args.numerics)
    method = race.methods_of(target, [args.method])[-1]
    options = {"draft_len": args.draft_len, **method.options}
    draft = options.get("draft")
    profile_call(target, race.warm_prompt(target), options, 32)

    rows, steps = [], []
    timers = [PassTimer(target)] + ([PassTimer(draft)] if draft is not None and hasattr(draft, "forward") else [])
    with ExitStack() as installed:
        for timer in timers:
            installed.enter_context(timer)
        for n, p in enumerate(prompts):
            ids = encode_prompt(target.tokenizer, p.text, chat=p.chat)
            row, call_steps = profile_call(target, ids, options, args.max_new_tokens)
            rows.append({"category": p.category, "id": p.id, **row})
            steps += call_steps
            print(f"[{n + 1}/{len(prompts)}] {p.category}: {row['tokens']} tokens in {row['seconds']:.2f} s, "
                  f"{row['steps']} steps (drafting {row['draft_seconds']:.2f} s, verifying {row['verify_seconds']:.2f} s, "
                  f"other {row['other_seconds']:.2f} s)", file=sys.stderr, flush=True)

    tokens = sum(r["tokens"] for r in rows)
    decode = sum(r["draft_seconds"] + r["verify_seconds"] for r in rows)
    report = {
        "settings": {"target": args.target, "numerics": args.numerics, "method": method.name, "draft_len": args.draft_len,
                     "prompts": f"{Path(args.prompts).name}, {args.rows} rows, {args.per_category} a category ({len(rows)} prompts)",
                     "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(), "cpu": _cpu_name(),
                     "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "totals": {"tokens": tokens, "seconds": sum(r["seconds"] for r in rows), "steps": len(steps),
                   "tokens_per_step": tokens / max(len(steps), 1), "decode_tokens_per_second": tokens / max(decode, 1e-9),
                   "draft_seconds": sum(r["draft_seconds"] for r in rows), "verify_seconds": sum(r["verify_seconds"] for r in rows),
                   "other_seconds": sum(r["other_seconds"] for r in rows)},
        "by_verify_width": by_width(steps),
        "passes": {"target": timers[0].table(), **({"draft": timers[1].table()} if len(timers) > 1 else {})},
        "rows": rows,
    }
    with open(f"{args.out}.json", "w") as f:
        json.dump(report, f, indent=1)
    try:
        plot(report, f"{args.out}.png")
    except ImportError:
        print("no plot: matplotlib is not installed", file=sys.stderr)
    print(json.dumps(report["totals"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
