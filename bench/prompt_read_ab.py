"""A prompt's read (`CausalLM.extend`: the last layer stops at its keys and values, no LM head) against a forward
pass whose logits are dropped (what prefill did before), in one process with the arms alternating.

    python bench/prompt_read_ab.py --rounds 8

Times `prefill.prefill` of the first 200 and 800 tokens of a source file on the q8 target and on the 0.5B Q4_0
draft `auto` uses beside it; prints the median of each (the first round dropped) and their ratio."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import verispec
from verispec import race
from verispec.models.base import CausalLM
from verispec.prefill import prefill


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b")
    parser.add_argument("--lengths", default="200,800")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = verispec.load(args.target, numerics="q8")
    draft = race.methods_of(target, [f"auto:{args.draft}"])[-1].options["draft"]
    ids = target.tokenizer(Path(verispec.__file__).with_name("engine.py").read_text())["input_ids"]
    lengths = [int(n) for n in args.lengths.split(",")]

    def timed(model, n: int, arm: str) -> float:
        if arm == "forward":  # the base class's read: a forward pass, its logits dropped
            model.extend = lambda tokens, cache, m=model: CausalLM.extend(m, tokens, cache)
        else:
            model.__dict__.pop("extend", None)
        started = time.perf_counter()
        prefill(model, [ids[:n]])
        return time.perf_counter() - started

    times: dict[tuple, list[float]] = {}
    for round_ in range(args.rounds):
        arms = ("extend", "forward") if round_ % 2 == 0 else ("forward", "extend")
        for name, model in (("target", target), ("draft", draft)):
            for n in lengths:
                for arm in arms:
                    times.setdefault((name, n, arm), []).append(timed(model, n, arm))
    for name in ("target", "draft"):
        for n in lengths:
            read, passed = (statistics.median(times[(name, n, arm)][1:]) for arm in ("extend", "forward"))
            print(f"{name} {n} tokens: extend {read * 1e3:.0f} ms, forward {passed * 1e3:.0f} ms: {read / passed:.3f}x the time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
