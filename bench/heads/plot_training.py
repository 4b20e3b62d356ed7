"""A head's held-out agreement with its target against the tokens it trained on, from its train.jsonl:
per draft position, and the tokens per target pass a greedy chain of 1..K drafts would give. Writes the
curve as JSON beside the plot, so the report outlives the head directory.

    python bench/heads/plot_training.py HEAD_DIR/train.jsonl bench/reports/head_training_qwen15b_q8
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from verispec.heads.train import expected_tokens_per_pass


def main() -> None:
    log, out = Path(sys.argv[1]), Path(sys.argv[2])
    curve = [r for r in map(json.loads, log.read_text().splitlines()) if "held_out" in r and "tokens" in r]
    if not curve:
        raise SystemExit(f"{log} has no held-out records (written at each checkpoint)")
    steps = len(curve[-1]["held_out"]["accuracy"])
    rows = [{"step": r["step"], "tokens": r["tokens"], "accuracy": r["held_out"]["accuracy"],
             "tokens_per_pass": [round(expected_tokens_per_pass(r["held_out"]["accuracy"], k), 3) for k in range(1, steps + 1)]}
            for r in curve]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    tokens = [r["tokens"] / 1e3 for r in rows]
    for i in range(steps):
        left.plot(tokens, [r["accuracy"][i] for r in rows], marker="o", label=f"draft position {i + 1}")
        right.plot(tokens, [r["tokens_per_pass"][i] for r in rows], marker="o", label=f"chain of {i + 1}")
    left.set(xlabel="training positions seen (thousands)", ylabel="held-out top-1 agreement with the target",
             title="agreement by draft position")
    right.set(xlabel="training positions seen (thousands)", ylabel="expected tokens per target pass",
              title="what a greedy chain would give")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(json.dumps(rows[-1]))


if __name__ == "__main__":
    main()
