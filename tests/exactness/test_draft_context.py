"""A draft model that reads only a prompt's last tokens (`ModelDrafter(context=...)`): the output stays plain
greedy decoding's for every drafter built on it; the draft really reads just the tail (its cache holds that
many tokens, and each draft is the draft model's own greedy continuation of the sequence without the prompt's
head, computed from scratch); readers handed in must have read that tail."""

from __future__ import annotations

import pytest
import torch

from conftest import perturbed_copy, tiny_llama
from test_greedy_equivalence import PROMPTS, plain
from verispec.drafters import HybridDrafter, ModelDrafter, StagedDrafter, SuffixDrafter
from verispec.engine import DecodeBatch, Request
from verispec.policy import FixedDraftLen, make_policy
from verispec.prefill import read_once, tail

CONTEXT = 3
LONG = [p * 3 for p in PROMPTS]  # every prompt longer than the context but one ([4] * 3)


def decode(target, drafter, prompts, policy, max_new_tokens=40) -> list[list[int]]:
    batch = DecodeBatch(target, drafter, policy)
    batch.add([Request(p, max_new_tokens=max_new_tokens, id=i) for i, p in enumerate(prompts)])
    outputs = {i: [] for i in range(len(prompts))}
    while len(batch):
        for event in batch.step():
            outputs[event.request_id].extend(event.tokens)
    return [outputs[i] for i in range(len(prompts))]


def windowed(kind: str, target, draft):
    model = ModelDrafter(draft, target.vocab_size, context=CONTEXT)
    if kind == "hybrid":
        return HybridDrafter(model)
    if kind == "staged":
        return StagedDrafter(model, SuffixDrafter(vocab_size=target.vocab_size))
    return model


@pytest.mark.parametrize("kind", ["model", "hybrid", "staged"])
@pytest.mark.parametrize("draft_len", [4, "auto"])
def test_a_draft_reading_the_prompt_tail_gives_plain_greedy_tokens(tiny_pair, kind, draft_len):
    target, draft = tiny_pair
    policy = FixedDraftLen(draft_len) if isinstance(draft_len, int) else make_policy(draft_len)
    for prompt in LONG:  # alone, then all together (rows of different lengths skip different heads)
        assert decode(target, windowed(kind, target, draft), [prompt], policy.fresh()) == [plain(target, prompt, 40)]
    assert decode(target, windowed(kind, target, draft), LONG, policy.fresh()) == [plain(target, p, 40) for p in LONG]


def test_the_draft_reads_only_the_tail_and_drafts_from_it():
    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.01)
    drafter = ModelDrafter(draft, target.vocab_size, context=CONTEXT)
    batch = DecodeBatch(target, drafter, FixedDraftLen(4))
    batch.add([Request(p, max_new_tokens=30, id=i) for i, p in enumerate(LONG)])
    assert drafter.cache.slots.num_tokens().tolist() == [min(len(p) - 1, CONTEXT) for p in LONG]
    skipped = [max(0, len(p) - 1 - CONTEXT) for p in LONG]
    assert drafter.skipped == skipped and any(skipped)
    original_propose, checked = drafter.propose, []

    def propose(sequences, draft_len, sampling, generators, stop=None, branch=None, **kwargs):
        proposed = original_propose(sequences, draft_len, sampling, generators, stop, branch, **kwargs)
        for b, sequence in enumerate(sequences):
            context = list(sequence[drafter.skipped[b] :])  # the row as the draft knows it
            for i in range(int(proposed.num_drafted[b])):
                with torch.no_grad():
                    token = int(draft.model(torch.tensor([context])).logits[0, -1].argmax())
                assert int(proposed.tokens[b, i]) == token, f"row {b}, step {len(checked)}, position {i}"
                context.append(token)
        checked.append(1)
        return proposed

    drafter.propose = propose
    outputs = {i: [] for i in range(len(LONG))}
    while len(batch):
        for event in batch.step():
            outputs[event.request_id].extend(event.tokens)
    assert [outputs[i] for i in range(len(LONG))] == [plain(target, p, 30) for p in LONG]
    assert len(checked) > 5


def test_readers_handed_in_must_have_read_the_tail(tiny_pair):
    target, draft = tiny_pair
    prompt = LONG[0]
    drafter = ModelDrafter(draft, target.vocab_size, context=CONTEXT)
    whole = read_once(draft, [prompt[:-1]])
    with pytest.raises(ValueError, match="each reader must have read"):
        drafter.add([prompt], readers=whole)
    drafter.add([prompt], readers=read_once(draft, [tail(prompt[:-1], CONTEXT)]))
    assert drafter.seen() == [len(prompt) - 1]
