"""The terms of staged drafting on this CPU: what a pass of w token rows costs the target and the draft model.

c = draft model 1-row pass / target 1-row pass (what a drafted token costs); v(w) = draft model w-row pass / its
1-row pass (what checking w - 1 stage-2 proposals in one pass costs). Staged drafting pays when the tokens a wide
draft pass yields, 1 + accepted proposals, beat v(w). Interleaved pass by pass (`costs.measure_width_costs_interleaved`).

    python bench/staged_costs.py --out bench/reports/staged_costs.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import verispec
from verispec.bench import _cpu_name
from verispec.costs import measure_width_costs_interleaved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--numerics", default="q8")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--widths", default="1,2,3,5,9")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    target = verispec.load(args.target, numerics=args.numerics)
    draft = verispec.load(args.draft, weight_dtype="int4")
    widths = [int(w) for w in args.widths.split(",")]
    target_costs, draft_costs = measure_width_costs_interleaved([target, draft], widths, repeats=args.repeats)
    report = {"target": f"{args.target} ({args.numerics})", "draft": f"{args.draft} int4", "cpu": _cpu_name(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "repeats": args.repeats,
              "target_ms": {w: 1e3 * s for w, s in target_costs.items()}, "draft_ms": {w: 1e3 * s for w, s in draft_costs.items()},
              "c": draft_costs[1] / target_costs[1], "draft_v": {w: draft_costs[w] / draft_costs[1] for w in widths},
              "target_v": {w: target_costs[w] / target_costs[1] for w in widths}}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
