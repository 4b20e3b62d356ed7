"""Penalties, logit_bias, min_tokens, min_p and logprobs stay exact under speculation.

The claim: at every draft position the target's logits are processed with the history plain decoding
would have had there (prompt + generated + the draft tokens before it), so greedy output is token for
token plain decoding's, sampled output follows the penalized distribution (chi-square, with a negative
control that forgets the draft prefix), and logprobs equal plain decoding's. Tiny random models.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import verispec
from conftest import EOS, perturbed_copy, tiny_llama, tiny_qwen2
from test_sampling_exactness import P_THRESHOLD, chi2_pvalue
from verispec.drafters import ModelDrafter
from verispec.engine import DecodeBatch, Request
from verispec.errors import VerispecError
from verispec.models.native import NativeCausalLM
from verispec.policy import FixedDraftLen
from verispec.sampling import SamplingParams, argmax, greedy_choice, process_logits, warp

OPTIONS = {
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.8),
    "repetition": dict(repetition_penalty=1.8),
    "negative-penalties": dict(presence_penalty=-0.4, frequency_penalty=-0.2),
    "logit_bias": dict(logit_bias={7: 3.0, 9: -100.0, 11: 2.5}),
    "min_tokens": dict(min_tokens=12),
    "min_p": dict(min_p=0.2),
    "all": dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={5: 2.0}, min_tokens=5, min_p=0.05),
}


def reference_process(logits: np.ndarray, params: SamplingParams, sequence: list[int], prompt_len: int, stops) -> np.ndarray:
    """One position, in numpy, from the definitions: bias, min_tokens, repetition (prompt + generated),
    frequency and presence (generated)."""
    z = logits.astype(np.float64).copy()
    for token, bias in params.logit_bias:
        z[token] += bias
    if len(sequence) - prompt_len < params.min_tokens:
        z[list(stops)] = -np.inf
    seen = set(sequence)
    for token in seen:
        z[token] = z[token] / params.repetition_penalty if z[token] > 0 else z[token] * params.repetition_penalty
    generated = sequence[prompt_len:]
    for token in set(generated):
        z[token] -= params.frequency_penalty * generated.count(token) + params.presence_penalty
    return z


def test_argmax_is_pytorchs_first_maximum_on_every_layout():
    """The numpy path every greedy token goes through takes each row's first maximum, as torch.argmax does:
    ties (many -inf and equal maxima), a NaN, a strided slice, 1-D, 3-D and inference tensors; other dtypes
    take torch's own."""
    rng = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 3, (4, 6, 50), generator=rng).float()  # many ties
    x[0, 0, 10:] = float("-inf")
    x[1, 2, 7] = float("nan")
    x[2, 3] = float("-inf")
    for case in (x, x[:, :, 5:40], x[:, 1], x[3, 4], x.to(torch.float64), x.to(torch.bfloat16)):
        assert torch.equal(argmax(case), case.argmax(-1)), case.shape
    with torch.inference_mode():
        y = x + 0
        assert torch.equal(argmax(y), y.argmax(-1))


def test_greedy_choice_is_the_argmax_and_its_softmax_probability():
    rng = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4000, generator=rng) * 4
    logits[0, 100:] = float("-inf")  # a restricted draft head's row
    logits[1, :3] = 50.0  # a tie at the top, and a near-certain row
    tokens, confidence = greedy_choice(logits)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(confidence, logits.softmax(-1).max(-1).values, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_process_logits_matches_the_definitions(name):
    params = SamplingParams(temperature=1.0, **OPTIONS[name])
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 32, generator=g) * 3
    sequence = [1, 5, 6, 5, 7, 7, 7, 20, 5, 31]  # prompt of 4, then 6 generated
    ours = process_logits(logits, params, sequence, 4, stop_token_ids=[EOS, 0])[0].numpy()
    np.testing.assert_allclose(ours, reference_process(logits[0].numpy(), params, sequence, 4, [EOS, 0]), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_pass_position_is_processed_as_a_plain_step_after_its_path(name):
    """Bitwise: row c with path p equals a one-position pass after sequence + p (chain and tree-like paths)."""
    params = SamplingParams(temperature=1.0, **OPTIONS[name])
    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(4)) * 3
    sequence = [1, 5, 6, 5, 7, 7]
    paths = [[], [5], [5, 9], [5, 9, 7], [12], [5, 9, 31]]  # a chain, then alternates beside positions 0 and 2
    both = process_logits(logits, params, sequence, 3, paths, [EOS])
    for c, path in enumerate(paths):
        alone = process_logits(logits[c : c + 1], params, sequence + path, 3, None, [EOS])[0]
        assert torch.equal(both[c], alone), f"position {c}"


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_one():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(5)) * 2
    params = SamplingParams(temperature=0.7, min_p=0.1)
    probs = (logits / 0.7).softmax(-1)
    keep = probs >= 0.1 * probs.max(-1, keepdim=True).values
    expected = torch.where(keep, probs, 0) / torch.where(keep, probs, 0).sum(-1, keepdim=True)
    torch.testing.assert_close(warp(logits, params), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bad", [dict(presence_penalty=3), dict(frequency_penalty="1"), dict(repetition_penalty=0),
                                 dict(min_p=1.5), dict(min_tokens=-1), dict(logit_bias={-1: 1.0}),
                                 dict(logit_bias={3: 200}), dict(logit_bias={3: True}), dict(logit_bias=[(1, 2), (1, 3)]),
                                 dict(logit_bias=5)], ids=str)
def test_bad_values_say_what_to_do(bad):
    with pytest.raises(VerispecError):
        SamplingParams(**bad)


def test_settings_with_a_bias_stay_hashable_and_equal():
    a = SamplingParams(logit_bias={3: 1.0, 2: -1})
    assert a == SamplingParams(logit_bias=[(2, -1.0), (3, 1)]) and hash(a) == hash(SamplingParams(logit_bias={2: -1, 3: 1}))


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(seed=0)
    return target, perturbed_copy(target, scale=0.3)  # wrong often enough that drafts get rejected


PROMPTS = [[1, 5, 6, 7, 5, 6], [1, 20, 21], [4, 4, 4, 9]]


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_greedy_output_with_each_option_is_plain_decodings(pair, name):
    target, draft = pair
    plain = verispec.generate(target, PROMPTS, drafter="none", max_new_tokens=24, **OPTIONS[name])
    spec = verispec.generate(target, PROMPTS, draft=draft, drafter="model", draft_len=3, max_new_tokens=24, **OPTIONS[name])
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert 0 < spec[0].stats.accepted_tokens < spec[0].stats.drafted_tokens  # drafts both accepted and rejected
    unprocessed = verispec.generate(target, PROMPTS, drafter="none", max_new_tokens=24)
    if name != "min_p":  # min_p does not move the argmax: the others must change something, or the test proves nothing
        assert [r.token_ids for r in plain] != [r.token_ids for r in unprocessed]


def test_min_tokens_holds_off_eos(pair):
    target, draft = pair
    biased = dict(logit_bias={EOS: 8.0}, max_new_tokens=20)  # EOS all but certain at every step
    assert verispec.generate(target, [1, 5, 6], drafter="none", **biased).token_ids == [EOS]
    result = verispec.generate(target, [1, 5, 6], draft=draft, drafter="model", draft_len=3, min_tokens=6, **biased)
    assert len(result.token_ids) == 7 and result.token_ids[-1] == EOS and EOS not in result.token_ids[:-1]


@pytest.mark.parametrize("processed", [False, True])
def test_logprobs_equal_plain_decodings(pair, processed):
    target, draft = pair
    options = dict(max_new_tokens=20, logprobs=3, processed_logprobs=processed, **OPTIONS["all"])
    plain = verispec.generate(target, PROMPTS, drafter="none", **options)
    spec = verispec.generate(target, PROMPTS, draft=draft, drafter="model", draft_len=3, **options)
    for s, p in zip(spec, plain):
        assert s.token_ids == p.token_ids and len(s.logprobs) == len(s.token_ids)
        assert [t.token for t in s.logprobs] == s.token_ids
        np.testing.assert_allclose([t.logprob for t in s.logprobs], [t.logprob for t in p.logprobs], atol=1e-5)
        assert [[i for i, _ in t.top] for t in s.logprobs] == [[i for i, _ in t.top] for t in p.logprobs]
        np.testing.assert_allclose([[v for _, v in t.top] for t in s.logprobs], [[v for _, v in t.top] for t in p.logprobs], atol=1e-5)
        assert all(len(t.top) == 3 and t.top[0][1] >= t.logprob - 1e-6 for t in s.logprobs)
    # raw logprobs are the model's own: a token the bias made certain keeps its unbiased logprob
    raw = verispec.generate(target, [1, 5, 6], drafter="none", max_new_tokens=1, logprobs=0, logit_bias={40: 50.0},
                            processed_logprobs=processed).logprobs[0]
    assert raw.token == 40 and (raw.logprob > -1e-4 if processed else raw.logprob < -0.5)


@pytest.fixture(scope="module")
def native_pair():
    hf = tiny_qwen2(seed=0)
    return NativeCausalLM.from_hf(hf), NativeCausalLM.from_hf(perturbed_copy(hf, scale=0.3))


def test_greedy_tree_passes_with_penalties_are_plain_decoding(native_pair):
    """Alternates beside chain positions: each is processed with its own path (chain prefix + itself)."""
    from test_trees import _Always

    target, draft = native_pair
    params = SamplingParams(**OPTIONS["all"])
    requests = lambda: [Request(prompt=p, sampling=params, max_new_tokens=30, id=i, logprobs=2)  # noqa: E731
                        for i, p in enumerate(PROMPTS)]

    def run(policy):
        batch = DecodeBatch(target, ModelDrafter(draft, target.vocab_size), policy)
        batch.add(requests())
        out = {i: ([], []) for i in range(len(PROMPTS))}
        while len(batch):
            for event in batch.step():
                out[event.request_id][0].extend(event.tokens)
                out[event.request_id][1].extend(event.logprobs)
        return out, batch.stats

    plain, _ = run(_Always(0))
    tree, stats = run(_Always(3))
    assert stats.alternates_accepted > 0  # alternates were taken, with their own paths
    for i in plain:
        assert tree[i][0] == plain[i][0]
        assert [(t.token, t.logprob, t.top) for t in tree[i][1]] == [(t.token, t.logprob, t.top) for t in plain[i][1]]


# --- the sampled distribution, with a penalty on ---------------------------------------------------

# Penalties that reward repeats: plain decoding repeats t1 often, which forgetting the draft prefix misses.
PENALIZED = SamplingParams(temperature=1.0, presence_penalty=-2.0, frequency_penalty=-1.0, repetition_penalty=0.7)


def penalized_joint(target, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """p(t1) p(t2 | t1) of plain decoding with the penalties, from the definitions (numpy)."""
    def dist(sequence):
        with torch.no_grad():
            logits = target.model(torch.tensor([sequence])).logits[0, -1].numpy()
        z = reference_process(logits, params, sequence, len(prompt), sorted(target.eos_token_ids)) / params.temperature
        p = np.exp(z - z.max())
        return p / p.sum()

    p1 = dist(prompt)
    joint = np.stack([p1[t] * dist(prompt + [t]) for t in range(len(p1))])
    joint[sorted(target.eos_token_ids)] = 0  # a row that ends at t1 has no t2
    return p1, joint.ravel() / joint.sum()


def sample_first_two(target, draft, prompt, params, rows=2000) -> list[list[int]]:
    batch = DecodeBatch(target, ModelDrafter(draft, target.vocab_size), FixedDraftLen(3))
    batch.add([Request(prompt, SamplingParams(**{**params.__dict__, "seed": 100 + i}), max_new_tokens=3, id=i) for i in range(rows)])
    outputs = [[] for _ in range(rows)]
    while len(batch):
        for event in batch.step():
            outputs[event.request_id] += event.tokens
    return outputs, batch.stats


def pvalues(target, prompt, params, outputs):
    p1, joint = penalized_joint(target, prompt, params)
    vocab = len(p1)
    first = np.array([o[0] for o in outputs])
    cells = np.array([o[0] * vocab + o[1] for o in outputs if len(o) >= 2])
    return chi2_pvalue(first, p1), chi2_pvalue(cells, joint)


@pytest.mark.parametrize("blockwise", [True, False])
def test_sampling_with_penalties_follows_plain_decodings_distribution(monkeypatch, blockwise):
    """2000 seeded rows: t1 and (t1, t2) follow plain decoding's penalized distribution. The draft is nearly
    the target, so t2 is mostly judged in the same pass as t1, where only the draft-prefix history
    rewards a repeat of t1. Forgetting that prefix (the negative control) is caught."""
    target = tiny_llama(seed=1)
    draft = perturbed_copy(target, scale=0.02)
    params = SamplingParams(**{**PENALIZED.__dict__, "blockwise": blockwise})
    prompt = [1, 5, 6]
    outputs, stats = sample_first_two(target, draft, prompt, params)
    assert stats.accepted_tokens > 0.3 * stats.drafted_tokens
    first, joint = pvalues(target, prompt, params, outputs)
    assert first > P_THRESHOLD and joint > P_THRESHOLD
    monkeypatch.setattr(DecodeBatch, "_draft_paths", staticmethod(lambda draft, row, width: [[]] * width))
    forgetful, _ = sample_first_two(target, draft, prompt, params)
    assert pvalues(target, prompt, params, forgetful)[1] < 1e-6


# --- reproducible seeds --------------------------------------------------------------------------

def test_a_seeded_call_gives_the_same_text_whatever_the_drafting(pair):
    """Seeded sampled calls are coupled by default: the same tokens with any draft length, with or
    without speculation. coupled=False keeps speculative sampling (its sample follows the drafting)."""
    target, draft = pair
    options = dict(temperature=0.9, seed=7, max_new_tokens=24, presence_penalty=0.5)
    plain = verispec.generate(target, PROMPTS, drafter="none", **options)
    for draft_len in (1, 3, "auto"):
        spec = verispec.generate(target, PROMPTS, draft=draft, drafter="model", draft_len=draft_len, **options)
        assert [r.token_ids for r in spec] == [r.token_ids for r in plain], draft_len
    uncoupled = [verispec.generate(target, PROMPTS, draft=draft, drafter="model", draft_len=k, coupled=False, **options)
                 for k in (1, 3)]
    assert [r.token_ids for r in uncoupled[0]] != [r.token_ids for r in uncoupled[1]]
