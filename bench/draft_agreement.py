"""How often a draft model's next token is the target's, by draft matrix format: the acceptance side of a cheaper draft.

The target answers each prompt greedily (its own tokens, as speculation verifies them); each draft then reads
prompt and answer in one pass (teacher-forced), and at every answer position its greedy choice is compared with
the target's token there. Reports, per `--draft-dtype`, the agreement rate and the tokens a pass a greedy chain
of `--chain` would get if every draft position were judged on the target's own text (a proxy of tokens per pass
that needs no timing, so it is the same on a busy machine). Time is the other side: `verispec bench --method
auto:DRAFT:DTYPE` races formats end to end.

    python bench/draft_agreement.py ../shared/data/humaneval_dev.jsonl ../shared/data/spec_bench_dev.jsonl \\
        --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --draft-dtype q4_0 --draft-dtype q3_0
"""

from __future__ import annotations

import argparse

import torch

import verispec
from verispec.race import race_prompts
from verispec.text import encode_prompt


def chain_tokens_per_pass(agrees: list[bool], chain: int) -> float:
    """Tokens a pass of greedy chains of `chain` drafts would emit over a text whose positions agree as `agrees`:
    each pass keeps the agreeing run from its first position (at most `chain`) and one token of the target's."""
    i = passes = 0
    while i < len(agrees):
        run = 0
        while run < chain and i + run < len(agrees) and agrees[i + run]:
            run += 1
        i += run + 1
        passes += 1
    return len(agrees) / passes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prompts", nargs="+", help="JSONL prompt files (HumanEval or Spec-Bench rows)")
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--numerics", default="q8")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--draft-dtype", action="append", required=True, help="a draft matrix format (repeat to compare)")
    p.add_argument("--rows", default="odd", choices=("all", "odd", "even"))
    p.add_argument("--per-category", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--chain", type=int, default=7)
    args = p.parse_args()

    target = verispec.load(args.target, numerics=args.numerics)
    texts = []
    for source in args.prompts:
        for prompt in race_prompts(source, args.rows, args.per_category):
            ids = encode_prompt(target.tokenizer, prompt.text, chat=prompt.chat)
            answer = verispec.generate(target, ids, drafter="ngram", max_new_tokens=args.max_new_tokens).token_ids
            texts.append((prompt.category, ids, answer))
    print(f"{len(texts)} prompts answered by {args.target} ({args.numerics}), up to {args.max_new_tokens} tokens each")
    for dtype in args.draft_dtype:
        draft = verispec.api.load_draft(args.draft, target, dtype)
        agree = total = 0
        per_text = []
        for _, ids, answer in texts:
            logits = draft.forward(torch.tensor([ids + answer]), draft.new_cache(1))[0]
            choices = logits[len(ids) - 1 : len(ids) - 1 + len(answer)].argmax(-1)
            agrees = (choices == torch.tensor(answer)).tolist()
            agree, total = agree + sum(agrees), total + len(agrees)
            per_text.append(chain_tokens_per_pass(agrees, args.chain))
        print(f"{dtype:8s} ({draft.name}): agreement {agree / total:.3f} over {total} positions, "
              f"tokens a pass with chains of {args.chain}: {sum(per_text) / len(per_text):.2f} (mean over prompts)")


if __name__ == "__main__":
    main()
