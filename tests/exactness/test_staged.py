"""Staged drafting (`StagedDrafter`): the draft model drafts by checking suffix proposals in one pass and keeping
what its own choices agree with. Its tokens must be exactly its own autoregressive draws: greedy output equals
plain decoding (tiny models of three architectures, the native int4 self copy on the target's cache, and the real
smollm2-135m); sampled output follows the target's distribution, while a stage 2 that accepts plausible
proposals without drawing is caught; stage 2 is really used; and the draft model's cache, rolled back by the
drafter over many steps and across rows of a batch, gives the tokens a fresh draft model gives."""

from __future__ import annotations

import pytest
import torch

import verispec
from conftest import perturbed_copy, tiny_llama
from test_greedy_equivalence import PROMPTS, plain
from test_sampling_exactness import P_THRESHOLD, first_two_tokens_pvalues, repeating_prompt, sample_with
from verispec.drafters import ModelDrafter, StagedDrafter, SuffixDrafter, SuffixIndex
from verispec.engine import DecodeBatch, Request
from verispec.models.native import NativeCausalLM
from verispec.policy import FixedDraftLen
from verispec.sampling import SamplingParams


def staged(target, draft, index: SuffixIndex | None = None) -> StagedDrafter:
    """A staged drafter over a draft model with its own cache, proposals from suffix lookup (in `index` too)."""
    return StagedDrafter(ModelDrafter(draft, target.vocab_size), SuffixDrafter(index, vocab_size=target.vocab_size))


def remembered(target, prompts: list[list[int]], max_new_tokens: int) -> SuffixIndex:
    """A suffix index holding each prompt with the target's greedy answer to it, as a server's holds the outputs
    of earlier requests: a repeated request gets its answer proposed. (Tiny random models never repeat their
    own text, so this is how their stage 2 gets proposals worth checking.)"""
    index = SuffixIndex()
    for prompt in prompts:
        index.add(prompt + plain(target, prompt, max_new_tokens))
    return index


@pytest.mark.parametrize("draft_len", [1, 3, 6, "auto"])
def test_staged_gives_plain_greedy_tokens(tiny_pair, draft_len):
    target, draft = tiny_pair
    for prompt in PROMPTS:
        got = verispec.generate(target, prompt, draft=draft, drafter="staged", draft_len=draft_len, max_new_tokens=40)
        assert got.token_ids == plain(target, prompt, 40), f"prompt {prompt}"


@pytest.mark.parametrize("draft_len", [2, 5, "auto"])
def test_staged_batch_equals_each_row_alone(tiny_pair, draft_len):
    target, draft = tiny_pair
    batch = verispec.generate(target, PROMPTS, draft=draft, drafter="staged", draft_len=draft_len, max_new_tokens=40)
    assert [r.token_ids for r in batch] == [plain(target, p, 40) for p in PROMPTS]


@pytest.mark.parametrize("draft_len", [3, "auto"])
def test_staged_self_copy_on_the_target_cache_gives_plain_greedy_tokens(draft_len):
    """No draft model: the native target's int4 copy drafts on the target's cache, which it leaves as found."""
    target = NativeCausalLM.from_hf(tiny_llama(seed=0))
    assert [r.token_ids for r in verispec.generate(target, PROMPTS, drafter="staged", draft_len=draft_len, max_new_tokens=40)] \
        == [plain(target, p, 40) for p in PROMPTS]
    for prompt in PROMPTS:
        assert verispec.generate(target, prompt, drafter="staged", draft_len=draft_len, max_new_tokens=40).token_ids \
            == plain(target, prompt, 40)


def test_stage_two_proposals_are_accepted_by_the_draft_model():
    """Not a vacuous pass: a repeated request gets its earlier answer proposed, the draft model keeps those
    proposals, so it drafts more tokens than it runs passes, and the output is still plain decoding's."""
    target = tiny_llama(seed=0)
    # the draft model is an exact copy of the target, so it agrees with that answer wherever it is proposed
    drafter = staged(target, perturbed_copy(target, scale=0.0), remembered(target, PROMPTS, 40))
    batch = DecodeBatch(target, drafter, FixedDraftLen(6))
    batch.add([Request(p, max_new_tokens=40, id=i) for i, p in enumerate(PROMPTS)])
    outputs = {}
    while len(batch):
        for event in batch.step():
            outputs.setdefault(event.request_id, []).extend(event.tokens)
    assert [outputs[i] for i in range(len(PROMPTS))] == [plain(target, p, 40) for p in PROMPTS]
    assert drafter.proposals_accepted > 40 and drafter.tokens_drafted > 5 * drafter.passes


def test_rolled_back_cache_drafts_what_a_fresh_draft_model_drafts():
    """Over many steps, rows of different lengths in one batch (holes in the shared slot axis): every greedy
    draft equals the draft model's own greedy continuation computed from scratch on the row's sequence. A
    cache that kept a rejected token, or dropped an accepted one, would draft from the wrong history."""
    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.01)  # on these flat random models, disagrees often: rejections to roll back
    drafter = staged(target, draft, remembered(target, [p * 2 for p in PROMPTS], 60))
    batch = DecodeBatch(target, drafter, FixedDraftLen(5))
    batch.add([Request(p * 2, max_new_tokens=60, id=i) for i, p in enumerate(PROMPTS)])
    original_propose, checked = drafter.propose, []

    def propose(sequences, draft_len, sampling, generators, stop=None, branch=None, **kwargs):
        proposed = original_propose(sequences, draft_len, sampling, generators, stop, branch, **kwargs)
        for b, sequence in enumerate(sequences):
            context = list(sequence)
            for i in range(int(proposed.num_drafted[b])):
                with torch.no_grad():
                    token = int(draft.model(torch.tensor([context])).logits[0, -1].argmax())
                assert int(proposed.tokens[b, i]) == token, f"row {b}, step {len(checked)}, position {i}"
                context.append(token)
        checked.append(proposed)
        return proposed

    drafter.propose = propose
    outputs = {}
    while len(batch):
        for event in batch.step():
            outputs.setdefault(event.request_id, []).extend(event.tokens)
    assert len(checked) >= 15 and drafter.proposals_accepted > 20
    assert [outputs[i] for i in range(len(PROMPTS))] == [plain(target, p * 2, 60) for p in PROMPTS]


class KeepsPlausibleProposals(StagedDrafter):
    """The bug exact staging must avoid: keeping a stage-2 proposal because the draft model finds it plausible
    (q >= 0.1) instead of drawing and comparing. The tokens handed on then no longer follow q, the q the outer
    verifier is given, so min(1, p/q) is applied to the wrong proposal."""

    @staticmethod
    def _choose(logits, sampling, generator, position, proposed):
        token, q, confidence = StagedDrafter._choose(logits, sampling, generator, position, None)
        if proposed is not None and q is not None and float(q[proposed]) >= 0.1:
            return proposed, q, confidence
        return token, q, confidence


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=1.2, top_k=12, top_p=0.9, seed=5)],
                         ids=str)
def test_staged_samples_the_target_distribution(params):
    """2000 seeded rows: the first two tokens follow the target's joint distribution p(t1) p(t2 | t1); the same
    test catches a stage 2 that keeps plausible proposals without drawing."""
    target = tiny_llama(seed=0)
    draft = perturbed_copy(target, scale=0.05)
    prompt = repeating_prompt(target)

    def drafter(kind):  # stage 2 always proposes (two tokens), the target's greedy answer where it has one
        return kind(ModelDrafter(draft, target.vocab_size), SuffixDrafter(remembered(target, [prompt], 3), vocab_size=target.vocab_size),
                    FixedDraftLen(2))

    exact_drafter = drafter(StagedDrafter)
    exact = sample_with(target, exact_drafter, FixedDraftLen(3), prompt, params)
    assert exact_drafter.proposals_accepted > 150  # stage 2 took part in the drafts being tested
    assert min(first_two_tokens_pvalues(target, prompt, params, exact)) > P_THRESHOLD
    biased = sample_with(target, drafter(KeepsPlausibleProposals), FixedDraftLen(3), prompt, params)
    assert min(first_two_tokens_pvalues(target, prompt, params, biased)) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["self-int4", "int8"])
def test_staged_on_smollm_gives_plain_greedy_tokens(draft):
    """The real smollm2-135m: its int4 copy on its cache (no draft model), or an int8 copy with its own cache."""
    from verispec import zoo

    zoo.pull("smollm2-135m")
    target = verispec.load("smollm2-135m")
    model = None if draft == "self-int4" else verispec.load(target.hf_model, tokenizer=target.tokenizer, weight_dtype="int8")
    prompts = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
               "The capital of France is Paris. The capital of France is"]
    for prompt in prompts:
        expected = verispec.generate(target, prompt, drafter="none", max_new_tokens=48).token_ids
        result = verispec.generate(target, prompt, draft=model, drafter="staged", max_new_tokens=48)
        assert result.token_ids == expected
    batch = verispec.generate(target, prompts, draft=model, drafter="staged", draft_len=4, max_new_tokens=48)
    assert [r.token_ids for r in batch] == [verispec.generate(target, p, drafter="none", max_new_tokens=48).token_ids
                                            for p in prompts]
