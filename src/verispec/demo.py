"""`verispec demo`: the default pair, plain vs speculative on one prompt: identical text, and how much faster."""

from __future__ import annotations

import sys

DEMO_PROMPT = '''from typing import List


def below_zero(operations: List[int]) -> bool:
    """ You're given a list of deposit and withdrawal operations on a bank account that starts with
    zero balance. Your task is to detect if at any point the balance of account falls below zero, and
    at that point function should return True. Otherwise it should return False.
    >>> below_zero([1, 2, 3])
    False
    >>> below_zero([1, 2, -4, 5])
    True
    """
'''


def run_demo(args) -> None:
    import verispec

    print(f"[demo] loading target {args.target} and draft {args.draft} (first run downloads and converts them)", file=sys.stderr)
    target = verispec.load(args.target)
    draft = verispec.load(args.draft, weight_dtype=args.draft_dtype)
    prompt = args.prompt or DEMO_PROMPT
    options = dict(max_new_tokens=args.max_new_tokens)
    # warm-up: first-call costs of both models (buffers, the kernels' thread pool, a first prefill) stay out of the timings
    warm = "def f(x):\n    return x + 1\n\n" * 8
    verispec.generate(target, warm, drafter="none", max_new_tokens=2)
    verispec.generate(target, warm, draft=draft, max_new_tokens=2)

    print("[demo] plain decoding ...", file=sys.stderr)
    plain = verispec.generate(target, prompt, drafter="none", **options)
    print("[demo] speculative decoding ...", file=sys.stderr)
    spec = verispec.generate(target, prompt, draft=draft, draft_len="auto", **options)

    print("=" * 72)
    print(prompt + spec.text)
    print("=" * 72)
    same = plain.token_ids == spec.token_ids
    speedup = plain.stats.total_seconds / spec.stats.total_seconds
    print(f"identical to plain decoding: {'yes' if same else 'NO'} ({len(spec.token_ids)} tokens)")
    print(f"plain:       {plain.stats.summary()}")
    print(f"speculative: {spec.stats.summary()}")
    print(f"speedup: {speedup:.2f}x   acceptance by position: "
          + ", ".join(f"{a:.0%}" for a in spec.stats.acceptance_by_position))
    if not same:
        raise SystemExit("speculative output differed from plain decoding: please report this")
