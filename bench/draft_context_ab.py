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

from pathlib import Path

import verispec
import verispec.api
from verispec.api import load_draft
from verispec.bench import read_prompts

from ab import arguments, report_against_plain, rows_against_plain


def main() -> None:
    parser = arguments(__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="full,128", help="comma-separated: full, or a token count")
    parser.add_argument("--humaneval", type=int, default=3, help="HumanEval dev prompts (odd rows)")
    parser.add_argument("--prompts", type=int, default=None, help="only the first N prompts (a smoke run)")
    args = parser.parse_args()

    target = verispec.load(args.target, numerics="q8")
    draft = load_draft(args.draft, target)
    default = verispec.api.DRAFT_CONTEXT
    variants = {"plain": (dict(drafter="none"), default)}
    for name in args.contexts.split(","):
        context = None if name == "full" else int(name)
        variants["auto, full prompt" if context is None else f"auto, last {context}"] = (dict(draft=draft), context)
    data = Path(args.data)
    prompts = read_prompts(str(data / "spec_bench_dev.jsonl"), 1) + read_prompts(str(data / "humaneval_dev.jsonl"), args.humaneval)
    names = list(variants)

    def options(name: str) -> dict:
        options, verispec.api.DRAFT_CONTEXT = variants[name]
        return options

    try:
        rows = rows_against_plain(target, prompts[: args.prompts], names, args.rounds, args.max_new_tokens, options)
    finally:
        verispec.api.DRAFT_CONTEXT = default
    report_against_plain(args, rows, names, "how much of the prompt the draft reads")


if __name__ == "__main__":
    main()
