"""Drafting across tokenizers (`CrossTokenizerDrafter`) is exact: real models with different tokenizers.

Greedy: token-identical to plain decoding (code, prose, a chat turn, text that splits characters over
byte-level tokens), alone and in a batch, at several draft lengths. Sampled: over many seeded rows the first
two tokens follow the target's exact joint distribution, and the same statistic catches a verifier that
takes a deterministic draft for a sample of p. The text round trip itself is checked by a model drafting
for itself through text, which the target must then accept almost always. Also: the drafter is chosen by
declaration (differing vocabularies), and a tokenizer-less draft with another vocabulary still fails clearly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import verispec
from verispec import zoo
from verispec.api import resolve_drafter
from verispec.errors import VerispecError

pytestmark = pytest.mark.slow

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n",
    "Translate to French and add an emoji: 'The café is open.' ->",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def pair():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    for name in ("qwen2.5-coder-0.5b", "smollm2-135m"):
        zoo.pull(name)
    yield verispec.load("qwen2.5-coder-0.5b"), verispec.load("smollm2-135m")
    torch.set_num_threads(threads)  # later modules' float sums (a tiny head's training) depend on it


@pytest.fixture(scope="module")
def plain(pair):
    target, _ = pair
    return [r.token_ids for r in verispec.generate(target, PROMPTS, drafter="none", max_new_tokens=NEW_TOKENS)]


def test_chosen_by_declaration(pair):
    target, draft = pair
    assert resolve_drafter(target, draft, "auto") == "cross_tokenizer"
    assert resolve_drafter(target, draft, "model") == "cross_tokenizer"
    assert resolve_drafter(target, target, "auto") == "model"  # one vocabulary: the token-level drafter
    with pytest.raises(VerispecError, match="different tokenizers.*drafter='model' or 'auto'"):
        verispec.generate(target, "hi", draft=draft, drafter="hybrid", max_new_tokens=2)


@pytest.mark.parametrize("draft_len", [1, 3, 6, "auto"])
def test_greedy_one_prompt_at_a_time(pair, plain, draft_len):
    target, draft = pair
    accepted = 0
    for prompt, expected in zip(PROMPTS, plain):
        result = verispec.generate(target, prompt, draft=draft, drafter="model", draft_len=draft_len,
                                   max_new_tokens=NEW_TOKENS)
        assert result.token_ids == expected, prompt
        assert result.stats.drafter == "CrossTokenizerDrafter"
        accepted += result.stats.accepted_tokens
    assert accepted > 10  # the draft's guesses did land


@pytest.mark.parametrize("draft_len", [2, 5])
def test_greedy_batch(pair, plain, draft_len):
    target, draft = pair
    results = verispec.generate(target, PROMPTS, draft=draft, draft_len=draft_len, max_new_tokens=NEW_TOKENS)
    assert [r.token_ids for r in results] == plain
    assert results[0].stats.accepted_tokens > 10


def test_greedy_chat_template(pair):
    """The target's chat template reaches the draft as text (both use ChatML markers here)."""
    target, draft = pair
    instruct = "Write a Python function that reverses a string."
    expected = verispec.generate(target, instruct, chat=True, drafter="none", max_new_tokens=NEW_TOKENS).token_ids
    result = verispec.generate(target, instruct, chat=True, draft=draft, draft_len=4, max_new_tokens=NEW_TOKENS)
    assert result.token_ids == expected


def test_text_round_trip_is_accepted(pair):
    """A model drafting for itself through text: any misalignment of the draft's context or a boundary
    artifact of the re-encoding would show up as rejections."""
    _, smollm = pair
    prompt = PROMPTS[0]
    expected = verispec.generate(smollm, prompt, drafter="none", max_new_tokens=48).token_ids
    result = verispec.generate(smollm, prompt, draft=smollm, drafter="cross_tokenizer", draft_len=4, max_new_tokens=48)
    assert result.token_ids == expected
    assert result.stats.drafter == "CrossTokenizerDrafter"
    assert result.stats.accepted_tokens / max(1, result.stats.drafted_tokens) > 0.9


# --- sampling ------------------------------------------------------------------------------------------

SAMPLED_PROMPT = "def add(a, b):\n    return"
TOP_K = 3
TEMPERATURE = 2.0  # flat enough that a draft token accepted too often shows (its p is ~0.75 here, not ~0.96)


def first_two_tokens(target, prompt: list[int], rows: int, **options) -> list[list[int]]:
    results = verispec.generate(target, [prompt] * rows, temperature=TEMPERATURE, top_k=TOP_K, seed=17, max_new_tokens=3,
                                draft_len=2, **options)
    return [r.token_ids[:2] for r in results], results[0].stats


def joint_reference(target, prompt: list[int]) -> dict[tuple[int, int], float]:
    """p(t1) p(t2 | t1) under top-k 3 at TEMPERATURE, from the target's own plain forward passes."""
    def top(tokens):
        logits = target.forward(torch.tensor([tokens]), target.new_cache(1), last_only=True)[0, -1].double() / TEMPERATURE
        values, ids = logits.topk(TOP_K)
        return dict(zip(ids.tolist(), values.softmax(0).tolist()))

    joint = {}
    for t1, p1 in top(prompt).items():
        for t2, p2 in top(prompt + [t1]).items():
            joint[(t1, t2)] = p1 * p2
    return joint


def pvalue(samples: list[list[int]], joint: dict) -> float:
    from scipy.stats import chisquare

    cells = list(joint)
    counts = np.array([sum(1 for s in samples if tuple(s) == cell) for cell in cells], dtype=float)
    assert counts.sum() == len(samples), "a sample outside the target's top-k support"
    expected = np.array([joint[c] for c in cells]) * len(samples)
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


@pytest.fixture(scope="module")
def sampling_pair(pair):
    """Target smollm2-135m, draft qwen2.5-coder-0.5b: the cheap model is the one run on every row's pass."""
    qwen, smollm = pair
    prompt = smollm.tokenizer(SAMPLED_PROMPT)["input_ids"]
    return smollm, qwen, prompt, joint_reference(smollm, prompt)


@pytest.mark.parametrize("coupled", [False, True], ids=["block", "coupled"])
def test_sampled_rows_follow_the_target(sampling_pair, coupled):
    target, draft, prompt, joint = sampling_pair
    samples, stats = first_two_tokens(target, prompt, 400, draft=draft, coupled=coupled)
    assert stats.drafter == "CrossTokenizerDrafter"
    assert 0 < stats.accepted_tokens < stats.drafted_tokens  # both the accept and the reject paths ran
    assert pvalue(samples, joint) > 1e-4


class TakesDraftForSample:
    """The bug to catch: a deterministic draft treated as a sample of p (accepted wherever p allows it)."""

    lossless = True
    takes_alternates = False

    def verify(self, draft, target_logits, sampling, generators, positions=None):
        from verispec.verifiers import BlockVerifier
        from verispec.sampling import warp_rows

        verdict = BlockVerifier().verify(draft, target_logits, sampling, generators, positions)
        p = warp_rows(target_logits.cpu(), sampling)
        for b in range(draft.tokens.shape[0]):
            drafted = int(draft.num_drafted[b])
            if drafted and int(verdict.num_accepted[b]) == 0 and p[b, 0, draft.tokens[b, 0]] > 0:
                verdict.num_accepted[b] = 1
                verdict.next_tokens[b] = int(torch.multinomial(p[b, 1], 1, generator=generators[b]))
        return verdict


def test_negative_control_is_caught(sampling_pair, monkeypatch):
    target, draft, prompt, joint = sampling_pair
    monkeypatch.setattr("verispec.engine.verifier_for", lambda sampling: TakesDraftForSample())
    samples, _ = first_two_tokens(target, prompt, 200, draft=draft, coupled=False)
    assert pvalue(samples, joint) < 1e-6


# --- the draft's context under arbitrary text ----------------------------------------------------------

class CheckedDrafter:
    """Wraps the drafter and checks, after every proposal, that the draft's tokens spell the target's text
    and that its cache holds exactly the tokens it says."""

    def __new__(cls, draft, target):
        from verispec.drafters.cross_tokenizer import CrossTokenizerDrafter

        class Checked(CrossTokenizerDrafter):
            checks = 0

            def propose(self, sequences, draft_len, *args, **kwargs):
                out = super().propose(sequences, draft_len, *args, **kwargs)
                if draft_len:
                    counts = self.cache.slots.num_tokens().tolist()
                    for row, seq, count in zip(self.rows, sequences, counts):
                        assert count == len(row.cached)
                        if row.target_read == len(seq):
                            spelled = self.draft_text.decode(row.aligned[len(self.draft_prefix) :])
                            assert spelled == row.text, (spelled[-40:], row.text[-40:])
                            Checked.checks += 1
                return out

        return Checked(draft, target)


def test_random_text_keeps_the_draft_in_line(pair):
    """Tiny random models with the real tokenizers write arbitrary tokens (byte pieces of characters, rare
    scripts, special tokens): the hardest text to follow. The output is still plain decoding's, and the
    draft's context spells the target's text at every step."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from verispec.engine import DecodeBatch, Request
    from verispec.models.hf import HFCausalLM
    from verispec.policy import FixedDraftLen

    qwen, smollm = pair
    torch.manual_seed(0)
    target = HFCausalLM(Qwen2ForCausalLM(Qwen2Config(vocab_size=qwen.vocab_size, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                     tie_word_embeddings=True)), qwen.tokenizer, name="tiny-qwen-tokenizer")
    draft = HFCausalLM(LlamaForCausalLM(LlamaConfig(vocab_size=smollm.vocab_size, hidden_size=32, intermediate_size=64,
                                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)),
                       smollm.tokenizer, name="tiny-smollm-tokenizer")
    prompts = [qwen.tokenizer(p)["input_ids"] for p in PROMPTS]
    expected = [r.token_ids for r in verispec.generate(target, prompts, drafter="none", max_new_tokens=40)]
    drafter = CheckedDrafter(draft, target)
    batch = DecodeBatch(target, drafter, FixedDraftLen(3))
    batch.add([Request(prompt=p, max_new_tokens=40, id=i) for i, p in enumerate(prompts)])
    out = {i: [] for i in range(len(prompts))}
    while len(batch):
        for event in batch.step():
            out[event.request_id] += event.tokens
    assert [out[i] for i in range(len(prompts))] == expected
    assert type(drafter).checks > 20
