"""`verispec certify`: check, for your own target, drafter and settings, that speculation changes nothing.

Two checks, each with its figures:

1. Greedy identity. A few bundled prompts (HumanEval and Spec-Bench) are decoded greedily by the target
   alone and with speculation; the token ids must be equal, every one. A mismatch names the prompt
   and the first position where the two part.
2. Sampling exactness, per lossless sampling rule (speculative sampling token by token, block
   verification, the coupled rule). For one short prompt, the target's exact distribution of the first
   two generated tokens, p(t1) p(t2 | t1), is computed from its logits (top_k keeps the support small,
   so the enumeration is cheap and every cell is seen often). Then `samples` rows are sampled with
   speculation, each with its own seed, and a chi-square goodness-of-fit test compares the counts with
   the exact distribution: the rule passes when p-value > `p_threshold` (1e-3 by default: a correct
   rule fails about once in a thousand runs; a rule that is wrong by a few percent of probability
   mass fails with near certainty at a few thousand samples). The prompt repeats a phrase and the
   target's own continuation of it, so prompt lookup drafts there too, and the draft tokens accepted and
   rejected are reported: a check where nothing was drafted proves nothing, and fails as such.

Typical acceptance and a speculative cascade can be asked for as modes too: they are lossy by design, and
certify shows by how much (the cascade needs a draft model: a draft without probabilities always defers).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from verispec.errors import VerispecError
from verispec.sampling import SamplingParams, warp

# How each mode samples: the rules `verifiers.verifier_for` picks for these settings.
MODES: dict[str, dict[str, Any]] = {
    "speculative_sampling": dict(blockwise=False),
    "block": dict(blockwise=True),
    "coupled": dict(coupled=True),
    "typical": dict(typical_acceptance=0.3),  # LOSSY by design: not a default mode
    "cascade": dict(cascade="diff:0.2"),  # LOSSY by design: keeps the draft's token where it is about as sure as the target
}
LOSSLESS_MODES = ("speculative_sampling", "block", "coupled")


@dataclass
class Check:
    name: str
    passed: bool
    summary: str  # one line with the figures
    figures: dict = field(default_factory=dict)


@dataclass
class Certificate:
    target: str
    drafter: str
    draft: str | None
    settings: dict
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def to_dict(self) -> dict:
        return {"target": self.target, "drafter": self.drafter, "draft": self.draft, "settings": self.settings,
                "passed": self.passed, "checks": [asdict(c) for c in self.checks]}

    def report(self) -> str:
        lines = [f"verispec certify: target {self.target}, drafter {self.drafter}" + (f" (draft {self.draft})" if self.draft else "")]
        lines += [f"  {'PASS' if c.passed else 'FAIL'}  {c.name}: {c.summary}" for c in self.checks]
        failed = [c.name for c in self.checks if not c.passed]
        lines.append("CERTIFIED: speculation gave the target's own output in every check" if self.passed
                     else f"NOT CERTIFIED: {len(failed)} of {len(self.checks)} checks failed ({', '.join(failed)})")
        return "\n".join(lines)


def chi_square(observed: dict, expected: dict, samples: int) -> tuple[float, int, float]:
    """Goodness of fit of `samples` draws: observed cell -> count, expected cell -> probability (cells with
    an expected count below 5 pooled into one). -> (statistic, degrees of freedom, p-value). A draw in a
    cell of probability zero gives p-value 0."""
    if any(count and expected.get(cell, 0.0) <= 0 for cell, count in observed.items()):
        return math.inf, 0, 0.0
    big = [cell for cell, prob in expected.items() if prob * samples >= 5]
    small = [cell for cell, prob in expected.items() if prob * samples < 5]
    obs = [observed.get(cell, 0) for cell in big]
    exp = [expected[cell] * samples for cell in big]
    if small and sum(expected[c] for c in small) * samples > 0:
        obs.append(sum(observed.get(c, 0) for c in small))
        exp.append(sum(expected[c] for c in small) * samples)
    scale = sum(obs) / sum(exp)  # expected probabilities sum to 1 up to rounding
    statistic = sum((o - e * scale) ** 2 / (e * scale) for o, e in zip(obs, exp))
    dof = len(obs) - 1
    if dof < 1:
        return statistic, dof, 1.0
    # chi-square survival function: the regularized upper incomplete gamma Q(dof / 2, statistic / 2)
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, dof, p_value


def exact_first_two(target, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """The target's distribution of its first two sampled tokens after `prompt`: (t1, t2) -> p(t1) p(t2 | t1),
    and (t1,) -> p(t1) where t1 ends the sequence (an EOS token)."""
    with torch.inference_mode():
        p1 = warp(target.forward(torch.tensor([prompt]), target.new_cache(1))[0, -1], params).double()
        support = [t for t in p1.nonzero().squeeze(1).tolist()]
        go_on = [t for t in support if t not in target.eos_token_ids]
        cells = {(t,): float(p1[t]) for t in support if t in target.eos_token_ids}
        if go_on:
            logits = target.forward(torch.tensor([prompt + [t] for t in go_on]), target.new_cache(len(go_on)))[:, -1]
            p2 = warp(logits, params).double()
            for row, t in enumerate(go_on):
                for t2 in p2[row].nonzero().squeeze(1).tolist():
                    cells[(t, t2)] = float(p1[t] * p2[row, t2])
    return cells


def _decode(target, make_drafter, draft_len, requests, stats=None) -> dict:
    from verispec.engine import DecodeBatch
    from verispec.policy import make_policy

    batch = DecodeBatch(target, make_drafter(), make_policy(draft_len), stats)
    batch.add(requests)
    outputs = {r.id: [] for r in requests}
    while len(batch):
        for event in batch.step():
            outputs[event.request_id] += event.tokens
    return outputs


def repeating_prompt(target, opening: list[int]) -> list[int]:
    """The opening, the target's greedy continuation of it, then the opening again: prompt lookup (and any
    drafter that reads the prompt) then proposes the continuation, which the target often accepts."""
    from verispec.engine import Request

    continuation = _decode(target, _plain, 1, [Request(opening, max_new_tokens=6, id=0)])[0]
    return opening + continuation + opening


def _plain():
    from verispec.drafters import NoDrafter

    return NoDrafter()


def greedy_identity(target, make_drafter, draft_len, prompts: list[list[int]], max_new_tokens: int) -> Check:
    from verispec.engine import Request
    from verispec.stats import SpecStats

    stats = SpecStats()
    requests = lambda: [Request(p, max_new_tokens=max_new_tokens, id=i) for i, p in enumerate(prompts)]  # noqa: E731
    plain = _decode(target, _plain, 1, requests())
    spec = _decode(target, make_drafter, draft_len, requests(), stats)
    mismatches = []
    for i in range(len(prompts)):
        if spec[i] != plain[i]:
            first = next((j for j, (a, b) in enumerate(zip(spec[i], plain[i])) if a != b), min(len(spec[i]), len(plain[i])))
            mismatches.append({"prompt": i, "first_difference": first, "plain": plain[i][first : first + 5],
                               "speculative": spec[i][first : first + 5]})
    tokens = sum(len(o) for o in plain.values())
    figures = {"prompts": len(prompts), "tokens": tokens, "drafted_tokens": stats.drafted_tokens,
               "accepted_tokens": stats.accepted_tokens, "tokens_per_pass": round(stats.mean_accepted_tokens, 3),
               "mismatches": mismatches}
    if mismatches:
        m = mismatches[0]
        summary = (f"{len(mismatches)} of {len(prompts)} prompts differ; prompt {m['prompt']} first at token "
                   f"{m['first_difference']} (plain {m['plain']}, speculative {m['speculative']})")
    else:
        summary = (f"{len(prompts)} prompts, {tokens} tokens identical to plain decoding "
                   f"({stats.accepted_tokens} of them accepted from {stats.drafted_tokens} drafted)")
    passed = not mismatches and stats.drafted_tokens > 0
    if not mismatches and not stats.drafted_tokens:
        summary += "; but nothing was drafted, so nothing was checked"
    return Check(f"greedy identity, draft_len {draft_len}", passed, summary, figures)


def sampling_exactness(target, make_drafter, draft_len, prompt: list[int], mode: str, samples: int, temperature: float,
                       top_k: int, p_threshold: float, seed: int) -> Check:
    from verispec.engine import Request
    from verispec.stats import SpecStats

    params = SamplingParams(temperature=temperature, top_k=top_k, **MODES[mode])
    expected = exact_first_two(target, prompt, params)
    stats = SpecStats()
    requests = [Request(prompt, SamplingParams(temperature=temperature, top_k=top_k, seed=seed + i, **MODES[mode]),
                        max_new_tokens=2, id=i) for i in range(samples)]
    outputs = _decode(target, make_drafter, draft_len, requests, stats)
    observed: dict[tuple[int, ...], int] = {}
    for tokens in outputs.values():
        cell = tuple(tokens[:2])
        observed[cell] = observed.get(cell, 0) + 1
    statistic, dof, p_value = chi_square(observed, expected, samples)
    figures = {"mode": mode, "samples": samples, "temperature": temperature, "top_k": top_k, "cells": len(expected),
               "chi_square": round(statistic, 3), "dof": dof, "p_value": p_value, "p_threshold": p_threshold,
               "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
               "lossy": mode not in LOSSLESS_MODES}
    worst = sorted(expected, key=lambda c: -abs(observed.get(c, 0) - expected[c] * samples))[:3]
    figures["largest_deviations"] = [{"tokens": list(c), "observed": observed.get(c, 0), "expected": round(expected[c] * samples, 1)}
                                     for c in worst]
    passed = p_value > p_threshold and stats.drafted_tokens > 0
    summary = (f"first two tokens over {samples} seeded samples against the target's exact distribution "
               f"({len(expected)} cells): chi2 = {statistic:.1f}, dof {dof}, p = {p_value:.3g} "
               f"{'>' if p_value > p_threshold else '<='} {p_threshold:g}; "
               f"{stats.accepted_tokens} of {stats.drafted_tokens} draft tokens accepted")
    if not stats.drafted_tokens:
        summary += "; but nothing was drafted, so nothing was checked"
    elif p_value <= p_threshold:
        c = figures["largest_deviations"][0]
        summary += f"; e.g. tokens {c['tokens']} came {c['observed']} times where {c['expected']} were expected"
    return Check(f"sampling, {mode}" + (" (LOSSY by design)" if mode not in LOSSLESS_MODES else "") + f", draft_len {draft_len}",
                 passed, summary, figures)


def bundled_prompts(target, count: int) -> list[list[int]]:
    """`count` prompts from the bundled HumanEval and Spec-Bench sets, alternating, as token ids."""
    from verispec.bench import read_prompts
    from verispec.text import encode_prompt

    code = read_prompts("humaneval", count)
    chat = read_prompts("spec_bench", 1)
    mixed = [p for pair in zip(code, chat) for p in pair] + code[len(chat):] + chat[len(code):]
    if target.tokenizer is None:  # token-id-only models: fixed ids from their vocabulary
        return [[(7 * i + 11 * j) % target.vocab_size or 1 for j in range(12)] for i in range(count)]
    return [encode_prompt(target.tokenizer, p.text, chat=p.chat) for p in mixed[:count]]


def certify(target, draft=None, drafter: str = "auto", draft_lens: tuple = (4,), modes: tuple = LOSSLESS_MODES,
            prompts: int = 4, max_new_tokens: int = 32, samples: int = 2000, temperature: float = 1.0, top_k: int = 4,
            p_threshold: float = 1e-3, seed: int = 0) -> Certificate:
    """Run both checks (see the module docstring) for `target` with `draft`/`drafter` at each draft length
    and each sampling mode. target, draft: names or loaded models, as for `verispec.generate`."""
    import verispec
    from verispec.api import make_drafter, resolve_drafter

    if samples < 100:
        raise VerispecError(f"samples must be at least 100 for a chi-square test to mean anything, got {samples}")
    if not 0 < p_threshold < 1:
        raise VerispecError(f"p_threshold must be in (0, 1), got {p_threshold}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise VerispecError(f"unknown sampling mode {unknown[0]!r}: use {', '.join(MODES)}")
    if temperature <= 0:
        raise VerispecError("the sampling check needs temperature > 0 (greedy decoding is checked by identity)")
    draft_lens = [getattr(d, "setting", d) for d in draft_lens]  # DraftLens as the CLI parses them, or as typed
    target = verispec.load(target)
    draft = verispec.load(draft) if draft is not None else None
    drafter = resolve_drafter(target, draft, drafter)
    make_drafter(target, draft, drafter)  # a bad choice fails now, with its message
    new_drafter = lambda: make_drafter(target, draft, drafter)  # noqa: E731
    certificate = Certificate(target.name, drafter, getattr(draft, "name", None),
                              {"draft_lens": list(draft_lens), "modes": list(modes), "prompts": prompts,
                               "max_new_tokens": max_new_tokens, "samples": samples, "temperature": temperature,
                               "top_k": top_k, "p_threshold": p_threshold, "seed": seed})
    started = time.perf_counter()
    greedy_prompts = bundled_prompts(target, prompts)
    sample_prompt = repeating_prompt(target, greedy_prompts[0][-6:])
    for draft_len in draft_lens:
        certificate.checks.append(greedy_identity(target, new_drafter, draft_len, greedy_prompts, max_new_tokens))
        for mode in modes:
            certificate.checks.append(sampling_exactness(target, new_drafter, draft_len, sample_prompt, mode, samples,
                                                         temperature, top_k, p_threshold, seed))
    certificate.settings["seconds"] = round(time.perf_counter() - started, 1)
    return certificate


def save(certificate: Certificate, path: str) -> None:
    with open(path, "w") as f:
        json.dump(certificate.to_dict(), f, indent=1)
